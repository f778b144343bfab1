"""Peak resident memory of 2 pipeline processes fine-tuning a pretrained Llama directory: the model
built in ``configure_model`` on the meta device and filled by ``pipeckpt.pretrained`` (each process
reads only its own stage's tensors), against ``from_pretrained`` in every process.

Why: docs/FINE_TUNING.md says what a process holds and peaks at under the recipe, measured. The model:
a Llama of ``LAYERS`` layers, hidden 1024, MLP 2816, vocabulary 32000 (about 1.6e8 parameters), saved
by ``save_pretrained`` in bf16 shards of 50 MB and trained in float32. Each launch (2 gloo processes on
CPU, one torch thread each, ``engine="distributed"``, pp2, balance by parameters) reports every rank's
peak RSS (``VmHWM``) at train start and the bytes of the parameters it holds: ``fixed`` is the
same recipe on a 2-layer model of width 64 (imports, process group, Trainer), then ``eager`` and
``meta`` the large one.

Command::

    python benchmarks/bench_fine_tune_memory.py --out OUT.md     # 2-4 min on 2 cores, ~4 GiB at most
"""

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any, Dict, List

LAYERS, HIDDEN, MLP, VOCAB, PP = 8, 1024, 2816, 32000, 2


def _config(layers: int, hidden: int, mlp: int, vocab: int) -> Any:
    import transformers

    return transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
        num_attention_heads=16 if hidden >= 1024 else 4, num_key_value_heads=8 if hidden >= 1024 else 2,
        max_position_embeddings=128, use_cache=False, tie_word_embeddings=False,
    )  # fmt: skip


def _peak_rss_kib() -> int:
    """This process's peak RSS since its exec (``VmHWM``): ``ru_maxrss`` would also count the
    launcher's peak, which a forked child inherits across exec, and the launcher built the models."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def _worker(path: str) -> None:
    import lightning as L
    import torch
    import transformers
    from torch.utils.data import DataLoader

    import pipeckpt

    torch.set_num_threads(1)
    with open(path) as f:
        spec = json.load(f)

    class FineTune(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            eager = spec["build"] == "eager"
            self.model = (
                transformers.AutoModelForCausalLM.from_pretrained(spec["dir"], dtype=torch.float32).train()
                if eager
                else None
            )

        def configure_model(self) -> None:
            if self.model is None:
                config = transformers.AutoConfig.from_pretrained(spec["dir"])
                model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
                self.model = pipeckpt.pretrained(model, spec["dir"])

        def configure_pipeline(self) -> Any:
            return pipeckpt.pipeline_of(self.model, "model.layers")

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return self.model(**batch).loss

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    class Reading(L.Callback):
        """Every rank's peak at train start, then out: the reading is the start, not a step."""

        def on_train_start(self, trainer: Any, module: Any) -> None:
            held = [p for p in module.parameters() if not p.is_meta]
            row = dict(
                build=spec["label"],
                rank=trainer.global_rank,
                s=time.perf_counter() - start,
                mib=_peak_rss_kib() / 1024,
                held_mib=sum(p.numel() * p.element_size() for p in held) / 2**20,
            )
            with open(os.path.join(spec["out"], f"rank{trainer.global_rank}.json"), "w") as f:
                json.dump([row], f)
            torch.distributed.barrier()
            os._exit(0)

    L.seed_everything(0)
    start = time.perf_counter()
    module = FineTune()
    strategy = pipeckpt.PipelineStrategy(engine="distributed", stages=PP, chunks=2, timeout=1200)
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=PP, max_steps=1, callbacks=[Reading()],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, num_sanity_val_steps=0,
    )  # fmt: skip
    ids = torch.randint(0, 64, (4, 32))
    trainer.fit(module, DataLoader([{"input_ids": ids, "labels": ids}], batch_size=None))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--worker", default=None)
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker)
        return
    import torch
    import transformers
    from harness.machine import machine
    from harness.ranks import run_ranks

    rows: List[Dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        sizes = {"small": (2, 64, 128, 64), "large": (LAYERS, HIDDEN, MLP, VOCAB)}
        params = {}
        for name, size in sizes.items():
            model = transformers.AutoModelForCausalLM.from_config(_config(*size), dtype=torch.float32)
            params[name] = sum(p.numel() for p in model.parameters())
            model.to(torch.bfloat16).save_pretrained(os.path.join(tmp, name), max_shard_size="50MB")
            del model
        for label, build, size in (
            ("fixed", "meta", "small"),
            ("eager", "eager", "large"),
            ("meta", "meta", "large"),
        ):
            spec = dict(label=label, build=build, dir=os.path.join(tmp, size))
            rows += run_ranks(os.path.abspath(__file__), PP, spec, timeout=900)
    n = params["large"]
    lines = [
        f"Machine: {machine()}. {PP} gloo processes, one torch thread each. Model: Llama, {LAYERS} "
        f"layers, hidden {HIDDEN}, MLP {MLP}, vocabulary {VOCAB}, {n / 1e6:.0f}M parameters "
        f"({n * 4 / 2**20:,.0f} MiB in float32; {n * 2 / 2**20:,.0f} MiB of bf16 files). Fixed: the same "
        "recipe on a 2-layer, width-64 model.",
        "",
        "| rank | fixed MiB | from_pretrained peak MiB | held MiB | meta + pretrained peak MiB | held MiB | "
        "eager s | meta s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    by = {(r["build"], r["rank"]): r for r in rows}
    for rank in range(PP):
        f, e, m = by[("fixed", rank)], by[("eager", rank)], by[("meta", rank)]
        lines.append(
            f"| {rank} | {f['mib']:,.0f} | {e['mib']:,.0f} | {e['held_mib']:,.0f} | {m['mib']:,.0f} | "
            f"{m['held_mib']:,.0f} | {e['s']:.0f} | {m['s']:.0f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    sys.exit(main())
