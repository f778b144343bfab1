"""A training step's outcome (its loss and reduced ``self.log`` records), from the last stage to
every rank of the pipeline, as one small tensor all-gather that also agrees on the stop requests.

Why not ``broadcast_object_list`` every step: it pickles, and sends twice (the size, then the bytes),
on a path every step of every rank waits on. The records' names and options rarely change between
steps, so they are sent as objects only when they do; otherwise one float64 tensor carries the loss
and the records' values (float32, exact in float64). Why not a broadcast: every rank adds its
preemption requests, so the step boundary needs no collective of its own to agree on them, and every
rank stops at the boundary after the step in which any rank was signalled
(:mod:`pipeckpt.state.preemption`). Why an all-gather rather than an all-reduce of the same tensor:
on gloo a small all-reduce costs about 1 ms of CPU per rank, an all-gather about two thirds of it,
and this runs every step on every rank (``benchmarks/bench_host_cost.py``).
"""

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from pipeckpt.state.preemption import PreemptionCallback

__all__: List[str] = []

Record = Tuple[str, Tensor, Dict[str, Any]]


def _same(a: List[Tuple[str, Dict[str, Any]]], b: List[Tuple[str, Dict[str, Any]]]) -> bool:
    try:
        return a == b
    except Exception:  # an option whose == is not a bool: send the records as objects
        return False


def _float32_scalars(records: List[Record]) -> bool:
    return all(v.dtype == torch.float32 and v.dim() == 0 for _, v, _ in records)


class StepOutcome:
    """Sends the last stage's training outcome to the other ranks of one pipeline, and agrees on
    the stop requests of ``stops`` on the way.

    Args:
        group: the pipeline's process group.
        src: the global rank of the pipeline's last stage.
        device: this rank's device (a tensor collective over NCCL needs one on the GPU).
        stops: the preemption callbacks whose requests ride on the step's collective (only when
            ``group`` spans every rank, so that every rank agrees); each is told the agreed request.
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        src: int,
        device: torch.device,
        stops: Sequence[PreemptionCallback] = (),
    ) -> None:
        self.group, self.src = group, src
        self.device = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
        self.stops = list(stops)
        self._row = dist.get_group_rank(group, src)  # the last stage's row of the gathered tensor
        self._size = dist.get_world_size(group)
        self._known: List[Tuple[str, Dict[str, Any]]] = []  # the records' names and options last sent

    def share(self, loss: Optional[Tensor], records: Optional[List[Record]]) -> Tuple[Tensor, List[Record]]:
        """The loss and the records, given on the last stage (None elsewhere), on every rank."""
        n = len(self._known)
        requests = [float(stop.requested) for stop in self.stops]
        if loss is not None and records is not None:
            shape = [(name, options) for name, _, options in records]
            known = len(records) == n and _same(shape, self._known) and _float32_scalars(records)
            values = [v.item() for _, v, _ in records] if known else [0.0] * n
            self._gather([float(not known), loss.item(), *values, *requests])
            if not known:
                self._objects(records)
            return loss, records
        new, value, *values = self._gather([0.0] * (2 + n) + requests)
        shared = torch.tensor(value, dtype=torch.float32)
        if new:
            return shared, self._objects(None)
        return shared, [
            (k, torch.tensor(v, dtype=torch.float32), dict(o)) for (k, o), v in zip(self._known, values)
        ]

    def _gather(self, sent: List[float]) -> List[float]:
        """Every rank's ``sent``, gathered: the outcome the last stage sent returned, and the stop
        requests at its end (any rank's) handed to their callbacks."""
        mine = torch.tensor(sent, dtype=torch.float64, device=self.device)
        rows = [torch.empty_like(mine) for _ in range(self._size)]
        dist.all_gather(rows, mine, group=self.group)
        k = len(sent) - len(self.stops)
        if self.stops:
            requested = torch.stack(rows)[:, k:].amax(dim=0).tolist()
            for stop, request in zip(self.stops, requested):
                stop.carry(request > 0)
        return rows[self._row][:k].tolist()

    def _objects(self, records: Optional[List[Record]]) -> List[Record]:
        box: List[Any] = [records]
        dist.broadcast_object_list(box, src=self.src, group=self.group)
        received: List[Record] = box[0]
        self._known = [(name, dict(options)) for name, _, options in received]
        return received
