"""The local engine's pipeline: GPipe's clock-cycle schedule, run by the calling thread.

Why no worker threads (torchgpipe's ``Pipeline`` ran one per device): on one device they buy no
parallelism and cost queue hand-offs and wake-ups per stage and micro-batch, several times the compute
on a dispatch-bound CPU proxy (``benchmarks/RESULTS_dispatch.md``); kernel launches are asynchronous,
so one host thread keeps several GPUs busy. Kept from torchgpipe: backward in reverse schedule order
(fork/join phony edges across devices) and deferred BatchNorm. Not kept: ``@skippable`` (refused;
return the skipped tensor in a tuple). docs/DESIGN.md, engines/local/pipeline.
"""

import warnings
from typing import Any, Dict, FrozenSet, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from pipeckpt._compat import fork_dependency, inspect_skip_layout, join_dependency, microbatch, tree_map
from pipeckpt._errors import PipeckptWarning, config_error
from pipeckpt.boundaries.microbatch import batch_size, gather, scatter
from pipeckpt.boundaries.pytrees import Flat, TensorOrTensors, first_tensor, to_device
from pipeckpt.boundaries.scalars import loss_weights
from pipeckpt.boundaries.side_inputs import Chain, Signatures, describe_call
from pipeckpt.checkpointing.layer_rng import LayerStreams
from pipeckpt.stages.caller import StepCasts, capture_caller_state, release_cast_cache
from pipeckpt.stages.partition import StagePlan, split
from pipeckpt.stages.stage import Stage, mark_shared_parameters, stage_modules

__all__: List[str] = []


def clock_cycles(m: int, n: int) -> List[List[Tuple[int, int]]]:
    """(micro-batch, stage) pairs of each clock cycle, as GPipe runs them: in cycle ``k``
    stage ``j`` runs micro-batch ``k - j``."""
    return [[(k - j, j) for j in range(max(1 + k - m, 0), min(1 + k, n))] for k in range(m + n - 1)]


def _first(x: Any) -> Tensor:
    if isinstance(x, Tensor):
        return x
    if type(x) is tuple and x and isinstance(x[0], Tensor):
        return x[0]
    found = first_tensor(x)
    assert found is not None, "ordered backward needs a tensor between stages"
    return found


def _with_first(x: Any, first: Tensor) -> Any:
    if isinstance(x, Tensor):
        return first
    if type(x) is tuple and x and isinstance(x[0], Tensor):
        return (first, *x[1:])
    old = _first(x)
    return tree_map(lambda t: first if t is old else t, x)


def _to(x: Any, device: torch.device) -> Any:
    if isinstance(x, Tensor):
        return x.to(device, non_blocking=True)
    return to_device(x, device)


def _tensors(x: Any) -> bool:
    return isinstance(x, Tensor) or (type(x) is tuple and bool(x) and all(isinstance(t, Tensor) for t in x))


class LocalPipeline:
    """Runs the stages of a plan as a GPipe pipeline inside this process.

    ``ordered_backward``: add torchgpipe's explicit backward-order edges between
    micro-batches; default only when the stages span several devices (one device's
    autograd thread already runs the schedule backwards). ``name`` and ``names``:
    the user's names of the Sequential and of its layers, for messages.
    """

    def __init__(
        self,
        sequential: nn.Sequential,
        plan: StagePlan,
        *,
        chunks: int,
        pin_memory: bool = True,
        ordered_backward: Optional[bool] = None,
        name: str = "layers",
        names: Optional[Sequence[str]] = None,
    ) -> None:
        self.plan = plan
        self.chunks = chunks
        self.name = name
        self.stages: List[Stage] = [
            Stage(part, index=j, mode=mode, device=device, pin_memory=pin_memory)
            for j, (part, mode, device) in enumerate(
                zip(split(sequential, plan.balance), plan.modes, plan.devices)
            )
        ]
        _refuse_skip_connections(self.stages)
        mark_shared_parameters(self.stages)
        self.ordered_backward = len(set(plan.devices)) > 1 if ordered_backward is None else ordered_backward
        self._warned_small_batch = False
        layers = list(sequential)
        names = list(names) if names is not None else [f"{name}.{i}" for i in range(len(layers))]
        for stage, (a, b) in zip(self.stages, plan.ranges):
            stage.layer_names = tuple(names[a:b])
        self.signatures = Signatures(name, list(zip(names, layers)))
        self._chains: Dict[FrozenSet[str], List[Tuple[Chain, Optional[FrozenSet[str]]]]] = {}
        self._checked_plain = False
        self.calls = 0  # pipelined calls, for the check that a step used the pipeline
        self.streams: Optional[LayerStreams] = None  # per-layer random streams; set by the engine
        self._sequential = sequential

    def place(self) -> None:
        for stage in self.stages:
            stage.to(stage.device)

    def _warn_small(self, batch: int, made: int) -> None:
        if made < self.chunks and not self._warned_small_batch:
            self._warned_small_batch = True
            warnings.warn(
                f"a batch of {batch} samples makes only {made} micro-batches for "
                f"chunks={self.chunks}; the pipeline runs with fewer micro-batches for such "
                "batches (typically the last, smaller batch of an epoch). HINT: use a batch "
                "size that is a multiple of chunks, or drop_last=True",
                PipeckptWarning,
                stacklevel=4,
            )

    def _scatter(self, input: TensorOrTensors) -> List[TensorOrTensors]:
        microbatch.check(input)
        first = self.plan.devices[0]
        input = input.to(first) if isinstance(input, Tensor) else tuple(x.to(first) for x in input)
        if self.chunks == 1:
            return [input]
        chunks = min(self.chunks, max(1, _first(input).size(0)))  # no more pieces than samples
        if isinstance(input, Tensor):
            batches: List[TensorOrTensors] = list(input.chunk(chunks))
        else:
            batches = list(zip(*(x.chunk(chunks) for x in input)))
        self._warn_small(_first(input).size(0), len(batches))
        return batches

    def _scatter_tree(
        self, args: Tuple[Any, ...], kwargs: Dict[str, Any]
    ) -> List[Tuple[Any, Dict[str, Any]]]:
        call = describe_call(self.name, args, kwargs)
        # The first argument stays flat (boundary.Flat) into the first stage's Call.
        pieces = scatter(args, kwargs, self.chunks, call=call, device=self.plan.devices[0], flat_first=True)
        if len(pieces) < self.chunks:
            self._warn_small(batch_size(args, call=call), len(pieces))
        return [(a[0], k) for a, k in pieces]

    def _gather(
        self, outputs: Sequence[Any], inputs: Sequence[Any], sides: Optional[List[Dict[str, Any]]]
    ) -> Any:
        first = outputs[0]
        if len(outputs) == 1:
            return first.value() if type(first) is Flat else first
        if isinstance(first, Tensor) and first.dim():
            return torch.cat(outputs)  # type: ignore[arg-type]
        if _tensors(first) and all(t.dim() for t in first):
            return tuple(torch.cat(parts) for parts in zip(*outputs))
        calls = [((x,), sides[i] if sides is not None else {}) for i, x in enumerate(inputs)]
        return gather(outputs, call=f"{self.name}(...)", weights=lambda: loss_weights(calls, shift=False))

    def _stage_chains(
        self, args: Tuple[Any, ...], kwargs: Dict[str, Any]
    ) -> List[Tuple[Chain, Optional[FrozenSet[str]]]]:
        """Per stage, its Chain and the side inputs it takes (None: every one of the call's),
        made once per set of keywords."""
        routes = self.signatures.routes(args, kwargs)
        keys = frozenset(kwargs)
        chains = self._chains.get(keys)
        if chains is None:
            chains = []
            for stage, (a, b) in zip(self.stages, self.plan.ranges):
                assert isinstance(stage.partition, nn.Sequential)
                chain = Chain(list(stage.partition), routes[a:b])
                wanted = chain.keys()
                chains.append((chain, None if wanted == keys else wanted))
            self._chains[keys] = chains
        return chains

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Pipelines one mini-batch; the output is on the last stage's device."""
        self.calls += 1
        release_cast_cache()  # nothing cast in an earlier step may serve this one
        stages = self.stages
        if self.streams is not None and self._sequential.training:  # the user's, which Lightning trains
            self.streams.next_call()
        if len(args) == 1 and not kwargs and _tensors(args[0]):  # today's tensor-only path
            if not self._checked_plain:  # once: does a layer need a side input?
                self.signatures.routes(args, kwargs)
                self._checked_plain = True
            batches: List[Any] = self._scatter(args[0])
            sides: Optional[List[Dict[str, Any]]] = None
        else:
            chains = self._stage_chains(args, kwargs)
            pieces = self._scatter_tree(args, kwargs)
            batches = [x for x, _ in pieces]
            sides = [k for _, k in pieces] if kwargs else None
            if sides is not None:
                for stage, (chain, _) in zip(stages, chains):
                    stage.chain = chain
        m = len(batches)
        inputs = list(batches)  # each micro-batch's input, for the weights of a 0-dim output
        caller = capture_caller_state()
        step = StepCasts(sum(s.recomputes_per_step(m) for s in stages))
        for stage in stages:
            stage.begin_step(m, caller, step=step)
        ordered = self.ordered_backward and torch.is_grad_enabled()
        for schedule in clock_cycles(m, len(stages)):
            for i, j in schedule:
                x = batches[i]
                if ordered and i > 0:
                    # batches[i - 1] holds micro-batch i-1's output of stage j - 1, whose
                    # backward must wait for micro-batch i's backward through stage j - 1.
                    prev, phony = fork_dependency(_first(batches[i - 1]))
                    batches[i - 1] = _with_first(batches[i - 1], prev)
                    x = _with_first(x, join_dependency(_first(x), phony))
                if j > 0 and stages[j].device != stages[j - 1].device:
                    x = _to(x, stages[j].device)
                if sides is None:
                    batches[i] = stages[j](x)
                else:
                    wanted = chains[j][1]
                    side = sides[i] if wanted is None else {k: v for k, v in sides[i].items() if k in wanted}
                    if side and stages[j].device != self.plan.devices[0]:
                        side = _to(side, stages[j].device)
                    batches[i] = stages[j](x, side or None)
        return self._gather(batches, inputs, sides)


def _refuse_skip_connections(stages: List[Stage]) -> None:
    layout = inspect_skip_layout(stage_modules(stages))
    across = sorted(name for (_, name), (a, b) in layout.by_ns_name.items() if a != b)
    if across:  # a stash and pop inside one stage needs no routing
        names = across
        raise config_error(
            f"torchgpipe skip connections {names}",
            "the local engine runs stages on the calling thread and does not route @skippable stash/pop",
            "return the skipped tensor with the layer's output as a tuple, and take it as a tuple in "
            "the layer that uses it",
        )
