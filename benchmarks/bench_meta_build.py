"""Peak resident memory of 4 pipeline processes building a ~1B-parameter model eagerly, against the
same model built in ``configure_model`` (on the meta device, each process making only its stage real).

Why: before the meta build, every rank built the whole model and then dropped the other ranks'
layers, so a model larger than one host could not start. The model: ``LAYERS`` blocks of
Linear(4096, 4096) + LayerNorm(4096) in bf16 (about 1.0e9 parameters, 1.9 GiB), so that 4 eager
processes fit a 24 GiB host. Each of three launches (4 gloo processes on CPU, one torch thread each,
``engine="distributed"``, pp4, balance by parameters) reports every rank's peak RSS
(``ru_maxrss``) at train start: ``fixed`` builds on meta a 4-block model of the same width (the
imports, process group, Trainer: what does not grow with the model, its one held block subtracted), then
``eager`` and ``meta`` the ~1B model. Target: every rank's ``meta`` peak at most ``fixed`` plus a
quarter of the model.

Command::

    python benchmarks/bench_meta_build.py --out OUT.md     # about 3 min on 2 cores, ~11 GiB at most
"""

import argparse
import json
import os
import resource
import sys
import time
from typing import Any, Dict, List

WIDTH, LAYERS, PP = 4096, 60, 4


def _model_bytes(layers: int, width: int) -> int:
    return layers * (width * width + 3 * width) * 2  # bf16: Linear weight and bias, LayerNorm's two


def _worker(path: str) -> None:
    import lightning as L
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from pipeckpt import PipelineStrategy

    torch.set_num_threads(1)
    with open(path) as f:
        spec = json.load(f)

    def layers() -> nn.Sequential:
        bf16, width = torch.bfloat16, spec["width"]

        def block() -> nn.Module:
            return nn.Sequential(nn.Linear(width, width, dtype=bf16), nn.LayerNorm(width, dtype=bf16))

        return nn.Sequential(*(block() for _ in range(spec["layers"])))

    class Big(L.LightningModule):
        def __init__(self, eager: bool) -> None:
            super().__init__()
            self.layers = layers() if eager else None

        def configure_model(self) -> None:
            if self.layers is None:
                self.layers = layers()

        def configure_pipeline(self) -> nn.Sequential:
            return self.layers

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return self.layers(batch[0].to(torch.bfloat16)).float().pow(2).mean()

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
                mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                held_mib=sum(p.numel() * p.element_size() for p in held) / 2**20,
            )
            with open(os.path.join(spec["out"], f"rank{trainer.global_rank}.json"), "w") as f:
                json.dump([row], f)
            torch.distributed.barrier()
            os._exit(0)

    L.seed_everything(0)
    start = time.perf_counter()
    module = Big(eager=spec["build"] == "eager")
    strategy = PipelineStrategy(engine="distributed", stages=PP, chunks=2, timeout=1200)
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=PP, max_steps=1, callbacks=[Reading()],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(module, DataLoader(TensorDataset(torch.randn(4, spec["width"])), batch_size=4))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--worker", default=None)
    parser.add_argument("--width", type=int, default=WIDTH, help="a smaller width for a quick try")
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker)
        return
    from harness.machine import machine
    from harness.ranks import run_ranks

    rows: List[Dict[str, Any]] = []
    for label, build, layers in (
        ("fixed", "eager", PP),
        ("eager", "eager", LAYERS),
        ("meta", "meta", LAYERS),
    ):
        spec = dict(label=label, build=build, layers=layers, width=args.width)
        rows += run_ranks(os.path.abspath(__file__), PP, spec, timeout=600)
    size = _model_bytes(LAYERS, args.width)
    quarter = size / PP / 2**20
    fixed = {r["rank"]: r["mib"] - r["held_mib"] for r in rows if r["build"] == "fixed"}
    lines = [
        f"Machine: {machine()}. {PP} gloo processes, one torch thread each. Model: {LAYERS} x "
        f"(Linear({args.width}, {args.width}) + LayerNorm({args.width})) in bf16, "
        f"{size / 2 / 1e9:.3f}e9 parameters, {size / 2**20:,.0f} MiB "
        f"(a quarter: {quarter:,.0f} MiB). Fixed cost: the 4-block meta run's peak less its held block.",
        "",
        "| rank | fixed MiB | eager peak MiB | meta peak MiB | meta held MiB | meta peak - fixed | "
        "target (quarter) | eager s | meta s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    by = {(r["build"], r["rank"]): r for r in rows}
    for rank in range(PP):
        e, m = by[("eager", rank)], by[("meta", rank)]
        lines.append(
            f"| {rank} | {fixed[rank]:,.0f} | {e['mib']:,.0f} | {m['mib']:,.0f} | {m['held_mib']:,.0f} | "
            f"{m['mib'] - fixed[rank]:,.0f} | {quarter:,.0f} | {e['s']:.0f} | {m['s']:.0f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    sys.exit(main())
