"""A training step's outcome (its loss and reduced ``self.log`` records), from the last stage to
every rank of the pipeline, as one small tensor broadcast that also carries the last stage's
decision on the stop requests.

Why not ``broadcast_object_list`` every step: it pickles, and sends twice (the size, then the bytes),
on a path every step of every rank waits on. The records' names and options rarely change between
steps, so they are sent as objects only when they do; otherwise one float64 tensor carries the loss
and the records' values (float32, exact in float64). The stop requests of every rank reach the last
stage through the store (:mod:`.requests`); its decision rides in the same tensor, so the step
boundary needs no collective of its own to agree on them (:mod:`pipeckpt.state.preemption`).
"""

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from pipeckpt.engines.distributed.requests import StopRelay
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
        stops: the preemption callbacks whose requests ride on the step's outcome (only when
            ``group`` spans every rank, so that every rank agrees); each is told the decided request.
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
        self.requests = StopRelay(stops, decides=dist.get_rank() == src, src=src)
        self._known: List[Tuple[str, Dict[str, Any]]] = []  # the records' names and options last sent

    def share(self, loss: Optional[Tensor], records: Optional[List[Record]]) -> Tuple[Tensor, List[Record]]:
        """The loss and the records, given on the last stage (None elsewhere), on every rank."""
        n = len(self._known)
        if loss is not None and records is not None:
            shape = [(name, options) for name, _, options in records]
            known = len(records) == n and _same(shape, self._known) and _float32_scalars(records)
            values = [v.item() for _, v, _ in records] if known else [0.0] * n
            requests = self.requests.decide()
            self._broadcast([float(not known), loss.item(), self.requests.generation, *values, *requests])
            if not known:
                self._objects(records)
            return loss, records
        self.requests.post()
        new, value, *values = self._broadcast([0.0] * (3 + n + len(self.requests)))
        shared = torch.tensor(value, dtype=torch.float32)
        if new:
            return shared, self._objects(None)
        return shared, [
            (k, torch.tensor(v, dtype=torch.float32), dict(o)) for (k, o), v in zip(self._known, values)
        ]

    def _broadcast(self, sent: List[float]) -> List[float]:
        """The last stage's ``sent`` on every rank: the stop decisions at its end handed to their
        callbacks, the store's prefix (third) learnt, the rest returned without it."""
        header = torch.tensor(sent, dtype=torch.float64, device=self.device)
        dist.broadcast(header, src=self.src, group=self.group)
        got = header.tolist()
        k = len(got) - len(self.requests)
        self.requests.tell(got[k:])
        self.requests.learn(got[2])
        return got[:2] + got[3:k]

    def _objects(self, records: Optional[List[Record]]) -> List[Record]:
        box: List[Any] = [records]
        dist.broadcast_object_list(box, src=self.src, group=self.group)
        received: List[Record] = box[0]
        self._known = [(name, dict(options)) for name, _, options in received]
        return received
