"""Offload: the inputs a stage keeps for its recomputes wait in host memory, and come back
before its backward needs them.

Why not torch's ``save_on_cpu``: it moves every saved tensor, on the compute stream, with no prefetch.
Why not a saved-tensor hook (torchtune's, Megatron's offloading): under a checkpoint mode the stage
knows which inputs wait and, from the schedule's op order, in which order backward wants them back.
Two layers: the copies (:class:`CudaCopies` on two side streams; :class:`HostCopies`, at once, for CPU
stages and tests) and the :class:`Offloader`, which issues the next entry's copy back while the
current one recomputes (docs/DESIGN.md, checkpointing/offload).
"""

import threading
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Protocol, Sequence, Tuple

import torch
from torch import Tensor

from pipeckpt.checkpointing.order import Op

__all__ = [
    "Copies",
    "HostCopies",
    "CudaCopies",
    "Offloader",
    "Parked",
    "copies_for",
    "backward_microbatches",
]


class Copies(Protocol):
    """The stream layer: where and on which stream the copies run."""

    def to_host(self, x: Tensor, *, pin_memory: bool) -> Any:
        """Issues the copy of ``x`` to host memory; returns what :meth:`to_device` takes."""
        ...

    def to_device(self, stored: Any, device: torch.device) -> Any:
        """Issues the copy of ``stored`` back to ``device``; returns what :meth:`use` takes."""
        ...

    def use(self, fetched: Any) -> Tensor:
        """The tensor, once the current stream has been made to wait for its copy."""
        ...


def _host_copy(x: Tensor, pin_memory: bool) -> Tensor:
    host = torch.empty(x.size(), dtype=x.dtype, layout=x.layout, pin_memory=pin_memory)
    host.copy_(x, non_blocking=pin_memory)
    return host


class HostCopies:
    """Every copy at once on the current stream: a CPU stage's (its inputs are in host memory
    already), and the calls :class:`CudaCopies` makes, in the same order, for CPU tests."""

    def to_host(self, x: Tensor, *, pin_memory: bool) -> Tensor:
        return _host_copy(x, pin_memory)

    def to_device(self, stored: Tensor, device: torch.device) -> Tensor:
        return stored.to(device, non_blocking=stored.device.type == "cpu" and device.type == "cuda")

    def use(self, fetched: Tensor) -> Tensor:
        return fetched


@dataclass(frozen=True)
class _Stored:
    host: Tensor
    done: Optional[torch.cuda.Event]  # recorded on the copy-out stream after the copy; None: no copy


@dataclass(frozen=True)
class _Fetched:
    tensor: Tensor
    ready: Optional[torch.cuda.Event]  # recorded on the copy-in stream after the copy; None: no copy


class CudaCopies:
    """Copies between one GPU and pinned host memory on two side streams of that GPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.out_stream = torch.cuda.Stream(device=device)
        self.in_stream = torch.cuda.Stream(device=device)

    def to_host(self, x: Tensor, *, pin_memory: bool) -> _Stored:
        if x.device != self.device:  # e.g. a CPU side tensor: it is in host memory already
            return _Stored(x if x.device.type == "cpu" else _host_copy(x, pin_memory), None)
        host = torch.empty(x.size(), dtype=x.dtype, layout=x.layout, pin_memory=pin_memory)
        self.out_stream.wait_stream(torch.cuda.current_stream(self.device))  # x has been computed
        with torch.cuda.stream(self.out_stream):
            host.copy_(x, non_blocking=pin_memory)
            done = torch.cuda.Event()
            done.record(self.out_stream)
        # x's memory goes back to the allocator when the stage lets go of it, which may be before
        # the copy has read it: record_stream keeps it from reuse until this stream gets there.
        x.record_stream(self.out_stream)
        return _Stored(host, done)

    def to_device(self, stored: _Stored, device: torch.device) -> _Fetched:
        if stored.done is None or device != self.device:
            return _Fetched(stored.host.to(device), None)
        self.in_stream.wait_event(stored.done)
        with torch.cuda.stream(self.in_stream):
            tensor = stored.host.to(device, non_blocking=stored.host.is_pinned())
            ready = torch.cuda.Event()
            ready.record(self.in_stream)
        return _Fetched(tensor, ready)

    def use(self, fetched: _Fetched) -> Tensor:
        if fetched.ready is None:
            return fetched.tensor
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(fetched.ready)
        # Allocated on the copy-in stream, used on the compute stream: its memory must not be
        # reused before the compute stream is done with it.
        fetched.tensor.record_stream(compute)
        return fetched.tensor


_HOST = HostCopies()
_cuda_copies: Dict[torch.device, CudaCopies] = {}
_cuda_lock = threading.Lock()


def copies_for(device: torch.device) -> Copies:
    """The copy layer for a stage on ``device``: one pair of side streams per GPU, shared by the
    stages on it; host copies at once for any other device."""
    if device.type != "cuda":
        return _HOST
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with _cuda_lock:
        if device not in _cuda_copies:
            _cuda_copies[device] = CudaCopies(device)
        return _cuda_copies[device]


def backward_microbatches(order: Sequence[Op], stage: int) -> List[int]:
    """The micro-batches in the order ``stage`` runs their backward, read off an op order
    (:mod:`pipeckpt.checkpointing.order`)."""
    return [op[2] for op in order if op[0] == stage and op[1] == "B"]


@dataclass(eq=False)
class Parked:
    """One checkpointed call's inputs, waiting in host memory for its backward."""

    microbatch: int
    number: int  # parked this many entries after the step's first: forward order
    stored: List[Any]
    devices: Tuple[torch.device, ...]
    requires: Tuple[bool, ...]
    fetched: Optional[List[Any]] = None  # the copies back, once issued
    used: bool = False


@dataclass
class Offloader:
    """A stage's offloaded inputs for one step, and the prefetch of the next ones in backward.

    ``ahead``: entries whose copy back is issued before the one backward asks for is used.
    """

    copies: Copies
    pin_memory: bool = True
    ahead: int = 1
    _rank: Dict[int, int] = field(default_factory=dict)  # micro-batch -> place in backward order
    _waiting: List[Parked] = field(default_factory=list)  # parked, not yet used
    _parked: int = 0

    def begin_step(self, backward_order: Sequence[int]) -> None:
        """A new step: its micro-batches in the order their backward runs on the stage. Entries
        left from a step whose backward never ran are let go."""
        self._rank = {m: k for k, m in enumerate(backward_order)}
        self._waiting = []
        self._parked = 0

    def park(self, microbatch: int, inputs: Sequence[Tensor]) -> Parked:
        """Issues the copies of ``inputs`` to the host; the entry backward hands to :meth:`fetch`."""
        entry = Parked(
            microbatch=microbatch,
            number=self._parked,
            stored=[self.copies.to_host(x, pin_memory=self.pin_memory) for x in inputs],
            devices=tuple(x.device for x in inputs),
            requires=tuple(x.requires_grad for x in inputs),
        )
        self._parked += 1
        self._waiting.append(entry)
        return entry

    def fetch(self, entry: Parked) -> List[Tensor]:
        """``entry``'s inputs back on their devices, as new leaves needing a gradient where the
        originals did. Issues the copy back of the next ``ahead`` entries first."""
        self._issue(entry)
        if entry in self._waiting:
            self._waiting.remove(entry)
        for following in self._next(self.ahead):
            self._issue(following)
        assert entry.fetched is not None
        tensors = [self.copies.use(f).requires_grad_(r) for f, r in zip(entry.fetched, entry.requires)]
        entry.stored, entry.fetched, entry.used = [], None, True
        return tensors

    def _issue(self, entry: Parked) -> None:
        if entry.fetched is None:
            entry.fetched = [self.copies.to_device(s, d) for s, d in zip(entry.stored, entry.devices)]

    def _next(self, n: int) -> List[Parked]:
        """The ``n`` waiting entries backward is expected to ask for first: micro-batches in the
        step's backward order (unknown ones last), within one the last parked first."""
        last = len(self._rank)
        return sorted(self._waiting, key=lambda e: (self._rank.get(e.microbatch, last), -e.number))[:n]
