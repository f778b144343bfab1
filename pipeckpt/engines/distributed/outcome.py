"""A training step's outcome (its loss and reduced ``self.log`` records), from the last stage to
every rank of the pipeline, as small point-to-point tensor messages that also agree on the stop
requests.

Why not ``broadcast_object_list`` every step: it pickles, and sends twice (the size, then the bytes),
on a path every step of every rank waits on. The records' names and options rarely change between
steps, so they are sent as objects only when they do; otherwise one float64 tensor carries the loss
and the records' values (float32, exact in float64). Every other rank first sends the last stage
its preemption requests, and the last stage sends back, with the outcome, the requests agreed (any
rank's), so the step boundary needs no collective of its own to agree on them, and every rank stops
at the boundary after the step in which any rank was signalled (:mod:`pipeckpt.state.preemption`).
Why messages rather than a collective: on gloo a small all-reduce costs about 1 ms of CPU per rank,
an all-gather about two thirds of it (both go through the process group's worker thread), and a
send and a receive about a quarter; this runs every step on every rank
(``benchmarks/bench_host_cost.py``). The messages go through the process group's own ``send`` and
``recv`` rather than ``dist.isend``/``dist.irecv``, whose checks and group lookups each cost about
30 us of Python per call measured here, more where the step's computation has left the code cold.
"""

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from pipeckpt.state.preemption import PreemptionCallback

__all__: List[str] = []

Record = Tuple[str, Tensor, Dict[str, Any]]

# The tag of the outcome's messages, apart from the schedule's own (tag 0) between the same ranks
# (gloo matches a message by its tag; NCCL keeps each pair's messages in order and ignores tags).
_TAG = 0x0C7


def _same(a: List[Tuple[str, Dict[str, Any]]], b: List[Tuple[str, Dict[str, Any]]]) -> bool:
    try:
        return a == b
    except Exception:  # an option whose == is not a bool: send the records as objects
        return False


def _float32_scalars(records: List[Record]) -> bool:
    return all(v.dtype == torch.float32 and v.dim() == 0 for _, v, _ in records)


class StepOutcome:
    """Sends the last stage's training outcome to the other ranks of one pipeline, and agrees on
    the stop requests of ``stops`` on the way (every rank's to the last stage, the agreed ones back).

    Args:
        group: the pipeline's process group.
        src: the global rank of the pipeline's last stage.
        device: this rank's device (a tensor collective over NCCL needs one on the GPU).
        stops: the preemption callbacks whose requests ride on the step's collective (only when
            ``group`` spans every rank, so that every rank agrees); each is told the agreed request.
            Every rank must give the same callbacks, in the same order.
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
        self._last = dist.get_rank() == src
        # The peers and the last stage as ranks of ``group``, the ranks its own send and recv take.
        self._peers = [dist.get_group_rank(group, r) for r in dist.get_process_group_ranks(group) if r != src]
        self._src = dist.get_group_rank(group, src)
        self._known: List[Tuple[str, Dict[str, Any]]] = []  # the records' names and options last sent
        self._buffers: Dict[Any, Tensor] = {}  # message buffers by use (see _buffer)
        self._sent_requests: Optional[List[float]] = None  # what the "requests" buffer holds

    def share(self, loss: Optional[Tensor], records: Optional[List[Record]]) -> Tuple[Tensor, List[Record]]:
        """The loss and the records, given on the last stage (None elsewhere), on every rank."""
        n = len(self._known)
        requests = [float(stop.requested) for stop in self.stops]
        if loss is not None and records is not None:
            shape = [(name, options) for name, _, options in records]
            known = len(records) == n and _same(shape, self._known) and _float32_scalars(records)
            values = [v.item() for _, v, _ in records] if known else [0.0] * n
            self._exchange([float(not known), loss.item(), *values], requests)
            if not known:
                self._objects(records)
            return loss, records
        new, value, *values = self._exchange([0.0] * (2 + n), requests)
        shared = torch.tensor(value, dtype=torch.float32)
        if new:
            return shared, self._objects(None)
        return shared, [
            (k, torch.tensor(v, dtype=torch.float32), dict(o)) for (k, o), v in zip(self._known, values)
        ]

    def _exchange(self, outcome: List[float], requests: List[float]) -> List[float]:
        """The last stage's ``outcome`` (its length on every rank), returned on every rank, and the
        ``requests`` agreed (any rank's) handed to the stop callbacks. Point-to-point: each other
        rank sends its requests to the last stage, which sends the outcome and the agreed requests
        back to each, so every rank leaves knowing every rank's requests of this step."""
        k = len(outcome)
        if self._last:
            agreed = requests
            if requests:  # every other rank's requests, then any rank's, in plain floats
                rows = [self._buffer(("peer", peer), len(requests)) for peer in self._peers]
                for work in [self._recv(row, peer) for row, peer in zip(rows, self._peers)]:
                    work.wait()
                agreed = [max(column) for column in zip(requests, *(row.tolist() for row in rows))]
            sent = torch.tensor(outcome + agreed, dtype=torch.float64, device=self.device)
            for sending in [self._send(sent, peer) for peer in self._peers]:
                sending.wait()
            values = outcome + agreed
        else:
            told = None
            if requests:
                told = self._send(self._requests(requests), self._src)
            received = self._buffer("received", k + len(requests))
            self._recv(received, self._src).wait()
            if told is not None:
                told.wait()
            values = received.tolist()
        for stop, request in zip(self.stops, values[k:]):
            stop.carry(request > 0)
        return values[:k]

    def _requests(self, requests: List[float]) -> Tensor:
        """``requests`` as the message that carries them: the last step's tensor while they are
        the same (they change once a run, if ever), as the step waited for its send to finish."""
        if requests != self._sent_requests:
            self._buffers["requests"] = torch.tensor(requests, dtype=torch.float64, device=self.device)
            self._sent_requests = requests
        return self._buffers["requests"]

    def _buffer(self, key: Any, n: int) -> Tensor:
        """A float64 message buffer of ``n`` values, kept between steps (each step waits for its
        messages before the next one reuses it)."""
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() != n:
            buffer = self._buffers[key] = torch.empty(n, dtype=torch.float64, device=self.device)
        return buffer

    def _send(self, tensor: Tensor, peer: int) -> dist.Work:
        """Sends ``tensor`` to ``peer`` (a rank of the group)."""
        return self.group.send([tensor], peer, _TAG)

    def _recv(self, into: Tensor, peer: int) -> dist.Work:
        """Receives from ``peer`` (a rank of the group) into ``into``."""
        return self.group.recv([into], peer, _TAG)

    def _objects(self, records: Optional[List[Record]]) -> List[Record]:
        box: List[Any] = [records]
        dist.broadcast_object_list(box, src=self.src, group=self.group)
        received: List[Record] = box[0]
        self._known = [(name, dict(options)) for name, _, options in received]
        return received
