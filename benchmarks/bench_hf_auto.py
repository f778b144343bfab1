"""``checkpoint='auto'`` on Hugging Face GPT-2 against per-block ``torch.utils.checkpoint``.

GPT-2 small's shape (12 blocks, d 768, 12 heads, GPT-2's vocabulary), random weights from its config,
sequence 128, batch 4, AdamW. The baseline is HF's own per-block checkpointing
(``gradient_checkpointing_enable``: each block under ``torch.utils.checkpoint``), trained by a plain
Trainer; its measured peak is the budget ``checkpoint='auto'`` plans the ``pipeline_of`` model to
(4 stages on the one CPU). Both train under real Trainers, side by side: the peak of a whole training
step (parameters, AdamW state, gradients, activations: every storage alive, counted by
``harness.live_bytes``, after a first step has made the optimizer's state) and the step's CPU
time, interleaved rounds, medians::

    python benchmarks/bench_hf_auto.py --rounds 3

Auto chooses the modes and the chunk count (``memory_search``; ``--search modes`` keeps
``--chunks``): the step's peak, at the optimizer's update, is the same for every method, and more
micro-batches add their own terms above it.
"""

import argparse
import statistics
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

import lightning as L
import torch
import transformers
from harness.live_bytes import LiveBytes
from harness.machine import machine
from torch import Tensor
from torch.utils.data import DataLoader

import pipeckpt

SEQ, BATCH, STEPS = 128, 4, 5


def gpt2() -> transformers.GPT2LMHeadModel:
    config = transformers.GPT2Config(
        n_layer=12, n_embd=768, n_head=12, n_positions=SEQ, use_cache=False,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


class GPT2Module(L.LightningModule):
    def __init__(self, *, per_block: bool) -> None:
        super().__init__()
        self.model = gpt2()
        if per_block:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def configure_pipeline(self) -> Any:
        return pipeckpt.pipeline_of(self.model, "transformer.h")

    def training_step(self, batch: Dict[str, Tensor], batch_idx: int) -> Tensor:
        loss: Tensor = self.model(**batch).loss
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class StepProbe(L.Callback):
    """The CPU time of every step after the second, and the peak of the second (``track``):
    the bytes alive at any moment of the step, parameters, gradients and the optimizer's state
    included (:class:`harness.live_bytes.LiveBytes`; torch's MemTracker keeps the inputs of
    selectively recomputed layers alive itself, see there)."""

    def __init__(self, *, track: bool) -> None:
        self.track = track
        self.times: List[float] = []
        self.peak = 0
        self.peak_op = ""
        self._tracker: Optional[LiveBytes] = None
        self._t0 = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # type: ignore[no-untyped-def]
        if batch_idx == 1 and self.track:
            self._tracker = LiveBytes()
            self._tracker.count_step_state(pl_module, trainer.optimizers, batch)
            self._tracker.__enter__()
        self._t0 = time.process_time()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
        took = time.process_time() - self._t0
        if self._tracker is not None:
            self._tracker.__exit__(None, None, None)
            self.peak, self.peak_op = self._tracker.peak, self._tracker.peak_op
            self._tracker = None
        elif batch_idx > 1:
            self.times.append(took)


def data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50257, (BATCH * STEPS, SEQ), generator=g)
    batches = [
        {"input_ids": ids[i : i + BATCH], "labels": ids[i : i + BATCH]} for i in range(0, len(ids), BATCH)
    ]
    return DataLoader(batches, batch_size=None)


def fit(module: L.LightningModule, strategy: Any, *, track: bool = True) -> StepProbe:
    probe = StepProbe(track=track)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=STEPS, callbacks=[probe], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        **({"strategy": strategy} if strategy is not None else {}),
    )  # fmt: skip
    trainer.fit(module, data())
    return probe


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--chunks", type=int, default=2)
    parser.add_argument(
        "--search",
        default="modes,chunks",
        help="what auto may choose (memory_search): modes, chunks, balance",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    base = fit(GPT2Module(per_block=True), None)
    log(f"per-block peak {base.peak} bytes at {base.peak_op}")
    auto = pipeckpt.PipelineStrategy(
        stages=args.stages,
        chunks=args.chunks,
        checkpoint="auto",
        memory_budget=base.peak,
        memory_search=args.search.split(","),
    )
    t0 = time.perf_counter()
    first = fit(GPT2Module(per_block=False), auto)
    log(f"{auto.auto_plan.describe()} (planned in {time.perf_counter() - t0:.0f} s wall, fit included)")
    log(f"auto peak {first.peak} bytes at {first.peak_op}")
    chosen = auto.auto_plan.settings
    plan = dict(stages=None, balance=chosen.balance, chunks=chosen.chunks, checkpoint=chosen.checkpoint)
    peaks = {"per-block": [base.peak], "auto": [first.peak]}  # the later rounds: times only
    times: Dict[str, List[float]] = {"per-block": list(base.times), "auto": list(first.times)}
    for r in range(args.rounds - 1):
        for key in ("auto", "per-block") if r % 2 == 0 else ("per-block", "auto"):
            if key == "auto":
                probe = fit(GPT2Module(per_block=False), pipeckpt.PipelineStrategy(**plan), track=False)
            else:
                probe = fit(GPT2Module(per_block=True), None, track=False)
            times[key].extend(probe.times)
        log(f"round {r + 2}: {times}")
    ratios = [a / b for a, b in zip(times["auto"], times["per-block"])]
    b_peak, a_peak = statistics.median(peaks["per-block"]), statistics.median(peaks["auto"])
    rounds = f"{args.rounds} interleaved rounds of {STEPS - 2} timed step(s)"
    print(f"{machine()}; {rounds}, CPU time, medians [range]\n")
    print(f"auto's plan: {auto.auto_plan.describe()}\n")
    print("| method | peak bytes (whole step) | peak vs per-block | step CPU s | time vs per-block [range] |")
    print("|---|---|---|---|---|")
    base_s = statistics.median(times["per-block"])
    print(f"| per-block torch.utils.checkpoint | {b_peak:.0f} | 1.000 | {base_s:.2f} | 1.00 |")
    print(
        f"| pipeckpt auto at that peak | {a_peak:.0f} | {a_peak / b_peak:.3f} | "
        f"{statistics.median(times['auto']):.2f} | {statistics.median(ratios):.2f} "
        f"[{min(ratios):.2f}-{max(ratios):.2f}] |"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
