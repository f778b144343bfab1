"""Peak resident memory at train start of processes that hold only their share of a model built on
the meta device, against what they hold and what a process costs before any model.

Why: a process of a pipeline built on the meta device should peak at its own stages' parameters plus
the cost of its imports, whatever the model's size; the whole model (an eager ``from_pretrained``
in every process) is what pipelining is to avoid. Two cases, each rank a real gloo process on CPU
(``engine="distributed"``, one torch thread each):

* ``llama``: a Hugging Face Llama (hidden 2048, 17 layers, vocabulary 32000: 1.005e9 parameters)
  saved with ``save_pretrained`` in bf16 shards to a temporary directory, fine-tuned in fp32 under
  pp4 on 4 processes, built from its config in ``configure_model`` and filled by
  ``pipeckpt.pretrained`` (``pipeline_of(model, "model.layers")``). Beside it, the eager baseline:
  ``from_pretrained(dir, dtype=float32)``, which every eager rank does first, measured as one
  process doing just that (four at once would not fit the shared 24 GiB machine).
* ``sequential``: 24 x ``nn.Linear(4096, 4096)`` (1,536 MiB fp32) built in ``configure_model`` as an
  ``nn.Sequential``, pp2 on 2 processes; beside it the same Sequential built in ``__init__``.

Each rank reads its peak (``VmHWM``) and current (``VmRSS``) resident memory from /proc/self/status
at train start and after its imports (before anything else), and the bytes of the parameters it holds
for real. Bound: held + imports + 15% of held, per rank.

Command::

    python benchmarks/bench_pretrained_memory.py --out /tmp/pretrained_memory.md   # ~2 min, ~8 GiB at most
    # (benchmarks/RESULTS_pretrained_memory.md: its table, main's beside it, and the diagnosis)
    python benchmarks/bench_pretrained_memory.py --smoke --out /tmp/smoke.md   # tiny sizes
    python benchmarks/bench_pretrained_memory.py --size medium --cases llama    # a 0.168e9 Llama
    python benchmarks/bench_pretrained_memory.py --size vocab --cases llama \
        --layouts pp2,pp4,pp2xfsdp2,pp2xtp2
    # (the vocabulary outweighs the layers: who holds the embedding and head, against a fair share;
    # pp2xtp2: the model's own tensor-parallel plan, the embedding and head split over the vocabulary)
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

import lightning as L
import torch
import transformers
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

import pipeckpt


def _status() -> Dict[str, float]:
    """This process's peak and current resident memory, MiB."""
    found: Dict[str, float] = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmHWM:", "VmRSS:")):
                key, value = line.split(":")
                found[key] = int(value.split()[0]) / 1024
    return found


_ = transformers.LlamaForCausalLM  # imported now, so that a rank's "imports" reading includes it

SIZES: Dict[str, Dict[str, Any]] = {
    "full": dict(hidden=2048, inter=5632, layers=17, heads=16, vocab=32000, width=4096, linears=24),
    "medium": dict(hidden=1024, inter=2816, layers=8, heads=8, vocab=32000, width=2048, linears=12),
    "smoke": dict(hidden=64, inter=128, layers=4, heads=4, vocab=256, width=64, linears=8),
    # The case where the vocabulary outweighs the layers: embedding and head 94% of the model.
    "vocab": dict(hidden=128, inter=344, layers=4, heads=4, vocab=32000, width=64, linears=8),
}


def _llama_config(size: Dict[str, Any]) -> Any:
    return transformers.LlamaConfig(
        vocab_size=size["vocab"], hidden_size=size["hidden"], intermediate_size=size["inter"],
        num_hidden_layers=size["layers"], num_attention_heads=size["heads"],
        num_key_value_heads=size["heads"], max_position_embeddings=256, use_cache=False,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip


class _Llama(L.LightningModule):
    def __init__(self, path: str) -> None:
        super().__init__()
        self.path, self.model = path, None

    def configure_model(self) -> None:
        if self.model is None:
            config = transformers.AutoConfig.from_pretrained(self.path)
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            self.model = pipeckpt.pretrained(model, self.path)

    def configure_pipeline(self) -> nn.Module:
        return pipeckpt.pipeline_of(self.model, "model.layers")

    def training_step(self, batch: Dict[str, Tensor], batch_idx: int) -> Tensor:
        return self.model(**batch).loss  # type: ignore[misc]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class _Linears(L.LightningModule):
    def __init__(self, width: int, count: int, eager: bool) -> None:
        super().__init__()
        self.width, self.count = width, count
        self.layers = self._build() if eager else None

    def _build(self) -> nn.Sequential:
        return nn.Sequential(*(nn.Linear(self.width, self.width) for _ in range(self.count)))

    def configure_model(self) -> None:
        if self.layers is None:
            self.layers = self._build()

    def configure_pipeline(self) -> nn.Sequential:
        return self.layers  # type: ignore[return-value]

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self.layers(batch[0]).pow(2).mean()  # type: ignore[misc]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def _reading(spec: Dict[str, Any], imports: float, start: float) -> "L.Callback":
    class Reading(L.Callback):
        """The rank's memory at train start, then out: the reading is the start, not a step."""

        def on_train_start(self, trainer: Any, module: Any) -> None:
            held = [
                p.to_local() if isinstance(p, DTensor) else p for p in module.parameters() if not p.is_meta
            ]
            row = dict(
                case=spec["case"], build=spec["build"], rank=trainer.global_rank, layout=spec.get("layout"),
                imports=imports, s=time.perf_counter() - start, **_status(), world=spec["world"],
                held=sum(p.numel() * p.element_size() for p in held) / 2**20,
            )  # fmt: skip
            with open(os.path.join(spec["out"], f"rank{trainer.global_rank}.json"), "w") as f:
                json.dump([row], f)
            torch.distributed.barrier()
            os._exit(0)

    return Reading()


def _worker(path: str) -> None:
    from torch.utils.data import DataLoader, TensorDataset

    imports, start = _status()["VmRSS"], time.perf_counter()
    torch.set_num_threads(1)
    with open(path) as f:
        spec = json.load(f)
    size = SIZES[spec["size"]]
    L.seed_everything(0)
    if spec["case"] == "llama":
        module: L.LightningModule = _Llama(spec["dir"])
        ids = torch.randint(0, size["vocab"], (4, 16))
        data: Any = DataLoader([{"input_ids": ids, "labels": ids}], batch_size=None)
    else:
        module = _Linears(size["width"], size["linears"], eager=spec["build"] == "eager")
        data = DataLoader(TensorDataset(torch.randn(4, size["width"])), batch_size=4)
    tp = spec.get("tp", 1)
    dp = spec["world"] // (spec["pp"] * tp)
    sharded: Dict[str, Any] = dict(dp=dp, data_parallel="fsdp") if dp > 1 else {}
    if tp > 1:  # the model's own plan: its layers, and its embedding and head over the vocabulary
        sharded.update(tensor_parallel=tp, data_parallel="fsdp")
    strategy = pipeckpt.PipelineStrategy(
        engine="distributed", stages=spec["pp"], chunks=2, timeout=1800, **sharded
    )
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=spec["world"], max_steps=1,
        callbacks=[_reading(spec, imports, start)], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
        num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(module, data)


def _save(size_name: str, directory: str) -> None:
    """The pretrained directory: random weights, bf16 shards (run in a process of its own)."""
    torch.manual_seed(0)
    config = _llama_config(SIZES[size_name])
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory, max_shard_size="500MB")


def _eager(directory: str) -> None:
    """What every eager rank does first: the whole model from the directory, in fp32."""
    imports = _status()["VmRSS"]
    start = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    held = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    row = dict(case="llama", build="eager", rank=0, imports=imports, held=held, s=time.perf_counter() - start)
    print(json.dumps(dict(row, **_status())))


def _run(args: List[str]) -> str:
    done = subprocess.run([sys.executable, os.path.abspath(__file__), *args], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(done.stdout[-3000:] + done.stderr[-3000:])
    return done.stdout


def _parameters(size: Dict[str, Any]) -> int:
    h, i, v, n = size["hidden"], size["inter"], size["vocab"], size["layers"]
    return 2 * v * h + h + n * (4 * h * h + 3 * h * i + 2 * h)  # untied embedding and head, norms


def _table(rows: List[Dict[str, Any]], size: Dict[str, Any]) -> List[str]:
    lines = [
        "| case | layout | build | rank | imports MiB | held MiB | held / fair share | bound MiB "
        "| peak (VmHWM) MiB | now (VmRSS) MiB | peak - imports - held | within bound | s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        fair = (_parameters(size) * 4 / 2**20 / r["world"]) if r["case"] == "llama" and "world" in r else None
        bound = r["imports"] + 1.15 * r["held"]
        excess = r["VmHWM"] - r["imports"] - r["held"]
        lines.append(
            f"| {r['case']} | {r.get('layout') or ''} | {r['build']} | {r['rank']} | {r['imports']:,.0f} | "
            f"{r['held']:,.2f} | {'%.2fx' % (r['held'] / fair) if fair else '-'} | "
            f"{bound:,.0f} | {r['VmHWM']:,.0f} | {r['VmRSS']:,.0f} | {excess:+,.0f} | "
            f"{'yes' if r['VmHWM'] <= bound else 'NO'} | {r['s']:.0f} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--save", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--eager", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: checks the harness, in seconds")
    parser.add_argument("--size", choices=sorted(SIZES), default="full", help="--smoke: --size smoke")
    parser.add_argument("--cases", default="sequential,llama")
    parser.add_argument(
        "--layouts", default="pp4", help="llama: pp<N>, pp<N>xfsdp<M> or pp<N>xtp<K>, comma-separated"
    )
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker)
        return
    if args.save:
        _save(*args.save)
        return
    if args.eager:
        _eager(args.eager)
        return
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from harness.machine import machine
    from harness.ranks import run_ranks

    size_name = "smoke" if args.smoke else args.size
    size, cases = SIZES[size_name], args.cases.split(",")
    rows: List[Dict[str, Any]] = []
    if "sequential" in cases:
        for build in ("meta", "eager"):
            spec = dict(case="sequential", build=build, size=size_name, pp=2, world=2)
            rows += run_ranks(os.path.abspath(__file__), 2, spec, timeout=1800)
    if "llama" in cases:
        with tempfile.TemporaryDirectory() as directory:
            _run(["--save", size_name, directory])
            for layout in args.layouts.split(","):  # "pp4", "pp2xfsdp2", "pp2xtp2"
                degrees = dict(
                    (d.rstrip("0123456789"), int(d[len(d.rstrip("0123456789")) :])) for d in layout.split("x")
                )
                pp, tp = degrees["pp"], degrees.get("tp", 1)
                world = pp * degrees.get("fsdp", 1) * tp
                spec = dict(
                    case="llama", build="meta", size=size_name, pp=pp, tp=tp, world=world, dir=directory
                )
                rows += run_ranks(os.path.abspath(__file__), world, dict(spec, layout=layout), timeout=1800)
            rows.append(json.loads(_run(["--eager", directory]).strip().splitlines()[-1]))
    linear = size["width"] * (size["width"] + 1) * size["linears"] * 4 / 2**20
    text = "\n".join(
        [
            f"Machine: {machine()}. One torch thread per process; MiB = 2**20 bytes.",
            f"sequential: {size['linears']} x Linear({size['width']}, {size['width']}), {linear:,.0f} MiB "
            "fp32, pp2 on 2 processes; meta = built in configure_model, eager = built in __init__.",
            f"llama: {_parameters(size) / 1e9:.3f}e9 parameters ({_parameters(size) * 4 / 2**20:,.0f} MiB "
            "fp32), saved in bf16 shards; meta = the layout's processes (pp<N>, x fsdp<M> replicas sharded, "
            "x tp<K> split by the model's own plan), "
            "built in configure_model and filled "
            "by pipeckpt.pretrained; eager = one process doing what every eager rank does first, "
            "from_pretrained(dir, dtype=float32).",
            "imports: VmRSS after the imports; held: parameters held for real (a shard's own bytes); "
            "held / fair share: held against all the parameters / the processes; "
            "bound: imports + 1.15 x held.",
            "",
            *_table(rows, size),
        ]
    )
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
