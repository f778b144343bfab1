"""The distributed engine's own cost per micro-batch and stage: the constant the layout cost model
adds to every forward and backward (pipeckpt/memory/engine_cost.py, ``ENGINE_S_PER_MICROBATCH``).

A 2-stage pipeline of a model so small that its kernels cost next to nothing (the project's MLP,
8 features, 2 hidden layers of 8) trains through a real ``Trainer`` on 2 gloo processes of one
torch thread each, GPipe, the same batch cut into 1 and into ``M`` micro-batches, interleaved over
rounds. Every micro-batch more adds one forward and one backward to each stage, run on the two
processes side by side, so ``(step(M) - step(1)) / (M - 1)`` is one stage's cost of one micro-batch
more: the schedule's, the engine's stage wrappers', gloo's send and receive, Lightning's nothing.
Medians over the rounds of the slower rank's seconds per step.

``--engine local``: the local engine's (torchgpipe) cost per micro-batch and stage on one device,
the constant ``checkpoint='auto'``'s time model adds there (pipeckpt/memory/engine_cost.py,
``LOCAL_ENGINE_S_PER_MICROBATCH``): the same model cut into ``--stages`` stages in one process of
one torch thread, every stage on the CPU. Its stages take turns on the one device, so
``(step(M) - step(1)) / ((M - 1) x stages)`` is one stage's cost of one micro-batch more: a stage
call, torchgpipe's hand-offs between its threads, the micro-batch's scatter and gather. Medians over
interleaved rounds of the process's CPU seconds per step (a shared machine's waits left out).

Commands::

    python benchmarks/bench_layout_engine_cost.py --rounds 5     # about a minute on 2 cores
    python benchmarks/bench_layout_engine_cost.py --engine local --stages 2 4 --rounds 7
"""

import json
import os
import statistics
import time
from typing import Any, Dict, List

import torch
import torch.distributed as dist
from bench_distributed import Measure, loader
from harness.ranks import joined, ranks_arguments, run_ranks
from harness.trainers import QUIET_CPU

MODEL = dict(in_features=8, hidden=8, depth=2, num_classes=2)
MANY = 16  # micro-batches in the long run


def _step_s(m: int, args: Any) -> float:
    import lightning as L

    from pipeckpt import PipelineStrategy
    from pipeckpt.app.models import MLP

    steps = args.warmup + args.timed + 1
    measure = Measure(args.warmup, args.timed)
    strategy = PipelineStrategy(
        engine="distributed", stages=2, chunks=m, schedule="gpipe", checkpoint="never"
    )
    trainer = L.Trainer(strategy=strategy, devices=2, max_steps=steps, callbacks=[measure], **QUIET_CPU)
    torch.manual_seed(0)
    data = loader(batch=args.batch, steps=steps, in_features=8, num_classes=2)
    trainer.fit(MLP(**MODEL), data)
    return measure.seconds_per_step()


class _CpuClock(Measure):
    """:class:`Measure` on this process's CPU time (one device: every thread of the engine counts)."""

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, idx: int) -> None:
        self.starts.append(time.process_time())


def _local_step_s(m: int, stages: int, args: Any) -> float:
    import lightning as L

    from pipeckpt import PipelineStrategy
    from pipeckpt.app.models import MLP

    steps = args.warmup + args.timed + 1
    measure = _CpuClock(args.warmup, args.timed)
    strategy = PipelineStrategy(engine="local", stages=stages, chunks=m, checkpoint="never")
    trainer = L.Trainer(strategy=strategy, devices=1, max_steps=steps, callbacks=[measure], **QUIET_CPU)
    torch.manual_seed(0)
    data = loader(batch=args.batch, steps=steps, in_features=8, num_classes=2)
    trainer.fit(MLP(**MODEL), data)
    return measure.seconds_per_step()


def local(args: Any) -> str:
    """The local engine's cost per micro-batch and stage, for each stage count in ``args.stages``."""
    torch.set_num_threads(1)
    began, lines = time.time(), []
    for stages in args.stages:
        per, ones = [], []
        for r in range(args.rounds):
            seconds = {m: _local_step_s(m, stages, args) for m in ((1, MANY) if r % 2 == 0 else (MANY, 1))}
            per.append((seconds[MANY] - seconds[1]) / ((MANY - 1) * stages))
            ones.append(seconds[1])
        lines.append(
            f"local engine, {stages} stages on one CPU, {args.rounds} rounds: cost per micro-batch and "
            f"stage, median {statistics.median(per) * 1e3:.3f} ms (rounds: "
            f"{' '.join(f'{p * 1e3:.3f}' for p in per)}); one micro-batch's step "
            f"{statistics.median(ones) * 1e3:.2f} ms"
        )
    return "\n".join(lines) + f" ({time.time() - began:.0f} s in all)\n"


def worker(spec_path: str) -> None:
    spec, args = joined(spec_path)
    rows: List[Dict[str, Any]] = []
    for r in range(args.rounds):
        for m in (1, MANY) if r % 2 == 0 else (MANY, 1):
            rows.append({"round": r, "m": m, "seconds": _step_s(m, args), "rank": dist.get_rank()})
    with open(os.path.join(spec["out"], f"rank{os.environ['LOCAL_RANK']}.json"), "w") as f:
        json.dump(rows, f)


def main() -> None:
    parser = ranks_arguments(__doc__.splitlines()[0], out="/dev/stdout", rounds=5, batch=MANY * 4)
    parser.add_argument("--engine", choices=("distributed", "local"), default="distributed")
    parser.add_argument("--stages", type=int, nargs="+", default=[2], help="--engine local: stage counts")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    if args.engine == "local":
        with open(args.out, "a") as f:
            f.write(local(args))
        return
    began = time.time()
    rows = run_ranks(__file__, 2, {"args": vars(args)}, timeout=args.timeout)
    slower: Dict[Any, float] = {}
    for row in rows:
        key = (row["round"], row["m"])
        slower[key] = max(slower.get(key, 0.0), row["seconds"])
    per = [(slower[(r, MANY)] - slower[(r, 1)]) / (MANY - 1) for r in range(args.rounds)]
    ones = [slower[(r, 1)] for r in range(args.rounds)]
    text = (
        f"engine cost per micro-batch and stage (GPipe, 2 gloo processes, {args.rounds} rounds, "
        f"{time.time() - began:.0f} s): median {statistics.median(per) * 1e3:.3f} ms "
        f"(rounds: {' '.join(f'{p * 1e3:.3f}' for p in per)}); one micro-batch's step "
        f"{statistics.median(ones) * 1e3:.2f} ms\n"
    )
    with open(args.out, "a") as f:
        f.write(text)


if __name__ == "__main__":
    main()
