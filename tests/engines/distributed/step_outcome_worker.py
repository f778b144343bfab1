"""One process of tests/engines/distributed/test_step_outcome.py: rank 1 plays the pipeline's last
stage and shares a scripted series of step outcomes through
:class:`pipeckpt.engines.distributed.outcome.StepOutcome`, while each rank records a stop request at
one step; each rank writes what it got, whether the records went as objects, and the stop request
its step boundary read, to ``rank<r>.json``:

    python tests/engines/distributed/step_outcome_worker.py SPEC.json
"""

import json
import os
import signal
from typing import Any, Dict, List

import torch
import torch.distributed as dist
from support.ranks import serve

from pipeckpt.engines.distributed.outcome import StepOutcome
from pipeckpt.state.preemption import PreemptionCallback

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
# The steps during which a rank records a stop request: rank 0 (the first stage) at 5, the last
# stage at 2.
REQUESTED_AT = {0: 5, 1: 2}


def run(one: Dict[str, Any], out: str, world: int) -> None:
    dist.init_process_group("gloo", rank=int(os.environ["LOCAL_RANK"]), world_size=world)
    last = dist.get_rank() == 1
    stop = PreemptionCallback(signum=signal.SIGUSR1)  # its handler is not installed: set by hand
    outcome = StepOutcome(dist.group.WORLD, 1, torch.device("cpu"), stops=[stop])
    sent_objects = []
    objects = outcome._objects

    def counted(records: Any) -> Any:
        sent_objects[-1] = True
        return objects(records)

    outcome._objects = counted  # type: ignore[method-assign]
    seen, stopped = [], []
    for i, records in enumerate(STEPS):
        stop.requested = i == REQUESTED_AT[dist.get_rank()]
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
        # The boundary's agreement, with no trainer: one not carried by the step would need it.
        stopped.append(stop._agreed_at_boundary(None))  # type: ignore[arg-type]
    with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump({"seen": seen, "objects": sent_objects, "stopped": stopped}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    serve(run)
