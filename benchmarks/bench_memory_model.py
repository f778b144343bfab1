"""Predicted vs measured per-stage peak memory of the local engine on CPU, as a Markdown table.

The same models, plans and measurement as tests/memory/test_memory.py (3 stages; never, except_last,
always, always:1, always:2, except_last:1, selective; 1-4 chunks), printed::

    python benchmarks/bench_memory_model.py > /tmp/memory_model.md     # about ten seconds
"""

import torch
from harness.memory_models import MODELS
from harness.memory_models import model_of as _model
from harness.memory_models import profile_of as _profile
from harness.stage_memory import measure_local_step

from pipeckpt.memory.predict import predict
from pipeckpt.sizes import MiB
from pipeckpt.stages.partition import plan

MODES = ("never", "except_last", "always", "always:1", "always:2", "except_last:1", "selective")


def main() -> None:
    torch.set_num_threads(1)
    print("| model | mode | chunks | stage | predicted MiB | measured MiB | error % |")
    print("|---|---|---|---|---|---|---|")
    worst = 0.0
    for name in MODELS:
        seq, x, y, loss = _model(name)
        for mode in MODES:
            for chunks in (1, 2, 3, 4):
                stage_plan = plan(
                    seq, devices=[torch.device("cpu")], stages=3, checkpoint=mode, chunks=chunks
                )
                predicted = predict(_profile(name, chunks), stage_plan, chunks=chunks, optimizer="sgd")
                measured, _ = measure_local_step(
                    seq, stage_plan, chunks=chunks, batch=x, loss_fn=lambda o, loss=loss, y=y: loss(o, y)
                )
                for s, m in zip(predicted.stages, measured):
                    error = 100 * (s.peak - m) / m
                    worst = max(worst, abs(error))
                    cells = (
                        name,
                        mode,
                        chunks,
                        s.stage,
                        f"{s.peak / MiB:.3f}",
                        f"{m / MiB:.3f}",
                        f"{error:+.1f}",
                    )
                    print("| " + " | ".join(str(c) for c in cells) + " |")
    print(f"\nlargest error: {worst:.1f}%")


if __name__ == "__main__":
    main()
