"""One process of tests/engines/distributed/test_step_outcome.py: rank 1 plays the pipeline's last
stage and shares a scripted series of step outcomes through
:class:`pipeckpt.engines.distributed.outcome.StepOutcome`; each rank writes what it got, and whether
the records went as objects, to ``rank<r>.json``:

    python tests/engines/distributed/step_outcome_worker.py SPEC.json
"""

import json
import os
from typing import Any, Dict, List

import torch
import torch.distributed as dist
from support.ranks import serve

from pipeckpt.engines.distributed.outcome import StepOutcome

MEAN = {"reduce_fx": "mean", "prog_bar": True}
SUM = {"reduce_fx": "sum", "prog_bar": False}
F32, F64 = torch.float32, torch.float64

# Each step's records on the last stage: (name, value, dtype, options).
STEPS: List[List[Any]] = [
    [("a", 1.5, F32, MEAN)],
    [("a", 0.1, F32, MEAN)],  # same names and options: values only
    [("a", 0.2, F32, MEAN), ("b", 3.0, F32, SUM)],  # a new name
    [("a", 0.3, F32, MEAN), ("b", 4.0, F32, SUM)],
    [],  # none
    [],
    [("a", 0.1, F64, MEAN)],  # not float32
    [("a", 0.2, F64, MEAN)],
]


def run(one: Dict[str, Any], out: str, world: int) -> None:
    dist.init_process_group("gloo", rank=int(os.environ["LOCAL_RANK"]), world_size=world)
    last = dist.get_rank() == 1
    outcome = StepOutcome(dist.group.WORLD, 1, torch.device("cpu"))
    sent_objects = []
    objects = outcome._objects

    def counted(records: Any) -> Any:
        sent_objects[-1] = True
        return objects(records)

    outcome._objects = counted  # type: ignore[method-assign]
    seen = []
    for i, records in enumerate(STEPS):
        loss = torch.tensor(0.1 * (i + 1), dtype=F32) if last else None
        given = [(n, torch.tensor(v, dtype=d), dict(o)) for n, v, d, o in records] if last else None
        sent_objects.append(False)
        got_loss, got = outcome.share(loss, given)
        seen.append(
            {
                "loss": [got_loss.item(), str(got_loss.dtype), list(got_loss.shape)],
                "records": [[n, v.item(), str(v.dtype), list(v.shape), o] for n, v, o in got],
            }
        )
    with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump({"seen": seen, "objects": sent_objects}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    serve(run)
