"""The checkpoint benchmark's measuring: each method's memory and step time, one Lightning step,
and the bitwise correctness check of the losses and gradients the memory runs returned.

Memory runs one forward + backward under :func:`checkpoint_memory.tracked`; time runs the methods
interleaved in rounds, each against the plain runs around it (the reasons are in
bench_checkpoint.py's docstring). Apart from the methods because other benchmarks
(bench_frontier.py, bench_perblock_match.py) measure their own methods with the same functions,
and from the report because nothing here formats a table.
"""

import gc
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Tuple

import lightning as L
import torch
from checkpoint_memory import mark_pending_gradients, tracked
from checkpoint_methods import LR, Config, Method, lm_loss
from lightning.fabric.plugins.environments import LightningEnvironment
from torch import Tensor, nn

from pipeckpt import PipelineStrategy
from pipeckpt.sizes import MiB


def make_batch(cfg: Config, seed: int = 0) -> Tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(cfg.vocab_size, (cfg.batch, cfg.seq_len), generator=g)
    y = torch.randint(cfg.vocab_size, (cfg.batch, cfg.seq_len), generator=g)
    return x, y


def timed_step(method: Method, x: Tensor, y: Tensor, optimizer: torch.optim.Optimizer) -> Tuple[float, float]:
    """Wall and process CPU seconds of forward + backward + optimizer step."""
    gc.disable()  # a collection inside a step would land on one method at random
    try:
        wall, cpu = time.perf_counter(), time.process_time()
        method.run(x, y, lambda loss: None)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - wall, time.process_time() - cpu
    finally:
        gc.enable()


def measure_memory(
    method: Method, model: nn.Module, x: Tensor, y: Tensor, seed: int
) -> Tuple[Tensor, List[Tensor]]:
    """Memory of one forward + backward (SGD's step allocates nothing); returns the loss
    and gradients for the correctness checks. The weights are not changed."""
    model.zero_grad(set_to_none=True)
    held: List[int] = []
    torch.manual_seed(seed)
    with tracked(model) as tracker:

        def probe(loss: Tensor) -> None:
            held.append(tracker.activation())
            mark_pending_gradients(loss, tracker)

        loss = method.run(x, y, probe)
    method.held_mib = held[0] / MiB if method.one_forward else None
    method.peak_mib = tracker.peak_activation / MiB
    method.categories_mib = tracker.peak_categories / MiB
    method.footprint_mib = tracker.peak_footprint / MiB
    grads = [p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return loss, grads


def measure_accumulating(method: Method, model: nn.Module, x: Tensor, y: Tensor) -> None:
    """Peak of activations + gradients when ``.grad`` already holds gradients (gradient
    accumulation over several batches, or ``zero_grad(set_to_none=False)``)."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    with tracked(model) as tracker:
        method.run(x, y, lambda loss: None)
    method.accumulating_mib = tracker.peak_footprint / MiB
    model.zero_grad(set_to_none=True)


def measure_time(
    methods: List[Method],
    x: Tensor,
    y: Tensor,
    optimizer: torch.optim.Optimizer,
    *,
    rounds: int,
    group: int,
    log: Callable[[str], None],
) -> None:
    plain, others = methods[0], methods[1:]
    for method in methods:
        timed_step(method, x, y, optimizer)  # warm-up
    for r in range(rounds):
        # Rotate the order so that no method always runs right after the baseline.
        order = others[r % len(others) :] + others[: r % len(others)]
        gc.collect()  # once per round: a full collection takes about a second here
        before = timed_step(plain, x, y, optimizer)
        for g in range(0, len(order), group):
            done = [(m, timed_step(m, x, y, optimizer)) for m in order[g : g + group]]
            after = timed_step(plain, x, y, optimizer)
            for m, (wall, cpu) in done:
                m.wall.append(wall)
                m.cpu.append(cpu)
                m.wall_ratios.append(wall / ((before[0] + after[0]) / 2))
                m.cpu_ratios.append(cpu / ((before[1] + after[1]) / 2))
            plain.wall.append(after[0])
            plain.cpu.append(after[1])
            before = after
        log(
            f"round {r + 1}/{rounds}: plain {statistics.median(plain.wall):.2f} s wall, "
            f"{statistics.median(plain.cpu):.2f} s CPU; CPU ratios "
            + ", ".join(f"{m.key} {m.cpu_ratios[-1]:.2f}" for m in others)
        )
    plain.wall_ratios = [1.0] * rounds
    plain.cpu_ratios = [1.0] * rounds


class _StepTimer(L.Callback):
    def __init__(self) -> None:
        self.wall: List[float] = []
        self.cpu: List[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # type: ignore[no-untyped-def]
        gc.collect()
        self._start = time.perf_counter(), time.process_time()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
        self.wall.append(time.perf_counter() - self._start[0])
        self.cpu.append(time.process_time() - self._start[1])


class _LM(L.LightningModule):
    def __init__(self, layers: nn.Sequential) -> None:
        super().__init__()
        self.layers = layers

    def configure_pipeline(self) -> nn.Sequential:
        return self.layers

    def training_step(self, batch: Tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return lm_loss(self.layers(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


def lightning_step(
    cfg: Config, x: Tensor, y: Tensor, plain: Method, optimizer: torch.optim.Optimizer, steps: int
) -> Tuple[float, float]:
    """Median (wall, CPU) ratio of a ``Trainer`` step with the pipe strategy (never) to the
    plain step run right before and after it."""
    torch.manual_seed(0)
    module = _LM(cfg.layers())
    data = torch.utils.data.TensorDataset(x.repeat(steps + 1, 1), y.repeat(steps + 1, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=cfg.batch)
    timer = _StepTimer()
    trainer = L.Trainer(
        strategy=PipelineStrategy(
            balance=cfg.balance, chunks=cfg.chunks, checkpoint="never", pin_memory=False
        ),
        accelerator="cpu",
        devices=1,
        max_steps=steps + 1,
        logger=False,
        callbacks=[timer],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        plugins=[LightningEnvironment()],
    )
    before = timed_step(plain, x, y, optimizer)
    trainer.fit(module, loader)
    after = timed_step(plain, x, y, optimizer)
    wall = statistics.median(timer.wall[1:]) / ((before[0] + after[0]) / 2)
    cpu = statistics.median(timer.cpu[1:]) / ((before[1] + after[1]) / 2)
    return wall, cpu


# --------------------------------------------------------------------------- checks


@dataclass
class Checks:
    lines: List[str] = field(default_factory=list)
    failures: List[str] = field(default_factory=list)

    def add(self, ok: bool, text: str) -> None:
        self.lines.append(f"- {'ok' if ok else 'MISMATCH'}: {text}")
        if not ok:
            self.failures.append(text)


def _relative(a: List[Tensor], b: List[Tensor]) -> str:
    worst = max(((p - q).abs().max() / q.abs().max().clamp_min(1e-30)).item() for p, q in zip(a, b))
    return f" (max relative difference {worst:.1e})"


def check(results: Dict[str, Tuple[Tensor, List[Tensor]]]) -> Checks:
    """Same weights, same seed, dropout on: pipeckpt's modes must give pipeckpt never's
    gradients bit for bit, and pipeckpt never must reproduce torchgpipe never."""
    checks = Checks()

    def same(a: str, b: str) -> Tuple[bool, str]:
        (la, ga), (lb, gb) = results[a], results[b]
        equal = torch.equal(la, lb) and all(torch.equal(p, q) for p, q in zip(ga, gb))
        return equal, "" if equal else _relative(ga, gb)

    for key in results:
        if key.startswith("pipeckpt-") and key != "pipeckpt-never":
            ok, detail = same(key, "pipeckpt-never")
            checks.add(ok, f"{key} loss and gradients bitwise equal to pipeckpt-never{detail}")
    (ours, _), (theirs, _) = results["pipeckpt-never"], results["torchgpipe-never"]
    checks.add(
        torch.equal(ours, theirs),
        f"pipeckpt-never loss {ours.item():.6f} equals torchgpipe-never loss "
        f"{theirs.item():.6f} (difference {(ours - theirs).abs().item():.1e})",
    )
    ok, detail = same("pipeckpt-never", "torchgpipe-never")
    checks.add(ok, f"pipeckpt-never gradients bitwise equal to torchgpipe-never{detail}")
    ok, detail = same("per-block", "plain")
    checks.add(ok, f"per-block torch.utils.checkpoint bitwise equal to plain{detail}")
    return checks
