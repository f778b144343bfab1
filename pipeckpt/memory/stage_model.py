"""One stage's numbers per micro-batch, read off the profile: what a micro-batch keeps from its
forward to its backward under a checkpoint mode, what is live while each layer runs forward, and
the events of its backward (recompute, then each layer's backward, segment by segment).

The walk (:mod:`pipeckpt.memory.walk`) puts these together op by op; :mod:`pipeckpt.memory.auto`
reads :meth:`_StageModel.kept` for the process peak. docs/MEMORY.md, "memory/stage_model.py", says
what each segment, Function and gradient holds.
"""

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple, TypeVar

from pipeckpt.checkpointing.modes import CheckpointMode
from pipeckpt.memory.outside_share import OutsideParam, stage_share
from pipeckpt.memory.profile import ModelProfile
from pipeckpt.memory.timing import selective_extra_s

__all__: List[str] = []

T = TypeVar("T")


def stage_model(
    profile: ModelProfile, start: int, stop: int, *, first: bool, last: bool, local: bool
) -> "_StageModel":
    """The stage of ``profile``'s layers ``start:stop``, made once per profile: a search predicts the
    same stage under many chunk counts and schedules, and what a stage keeps and frees per mode
    (:meth:`_StageModel.kept_ids`, :meth:`~_StageModel.backward_events`) was most of its time."""
    key = ("stage", start, stop, first, last, local)
    made = profile.derived.get(key)
    if made is None:
        made = profile.derived[key] = _StageModel(profile, start, stop, first=first, last=last, local=local)
    return made


@dataclass
class _StageModel:
    """The per-micro-batch numbers of one stage, from the profile. Under the distributed engine
    the stage input lives in torch's receive buffer (counted apart), so it is left out here."""

    profile: ModelProfile
    start: int
    stop: int
    first: bool
    last: bool
    local: bool

    def __post_init__(self) -> None:
        p = self.profile
        self.layers = p.layers[self.start : self.stop]
        # The first stage's input is the data's, except that a pipeline_of model's own code makes it
        # per micro-batch on the local engine (its embeddings' output), held as every stage's input is.
        made = self.local and p.outside is not None
        # A pipeline_of model's forward calls its layers one by one, each call its own checkpoint under
        # the stage's mode (stages/stage.py ``call_layer``): a recompute keeps every layer's input.
        self.layer_calls = p.outside is not None
        self.inputs: Set[int] = set(self.layers[0].inputs) if made or not self.first else set()
        self.input_bytes = p.bytes_of(self.inputs)
        self.outputs: Set[int] = set(self.layers[-1].outputs)
        self.output_bytes = p.bytes_of(self.outputs)
        # What torch's PipelineStage receives per micro-batch, each in a buffer of its own: the
        # activations it takes (not on the first stage) and the gradients of what it sends (not on
        # the last). A pipeline_of model's stage on the distributed engine sends the layer outputs a
        # later stage reads (engines/distributed/handoffs.py): the layer before the next stage's for
        # a decoder, an encoder's last beside it, MoE router logits to the last. Not probed: every
        # layer output so far, as the engine sends then.
        rooted = not self.local and p.outside is not None
        self.received_bytes = self.input_bytes if self.first or not rooted else self._crossing(self.start)
        self.returned_bytes = 0 if self.last else self._crossing(self.stop) if rooted else self.output_bytes
        # The last stage holds what runs after the layers (a pipeline_of model's own parameters). Trained
        # parameters get gradients and optimizer state; frozen ones are only held.
        after = [p.loss] if self.last and p.loss is not None else []
        # Under the distributed engine a pipeline_of model's rank holds of them what its stage reads
        # (memory/outside_share.py), not the last stage all of them.
        share = self.outside_share()
        after = [] if share is not None else after
        self.param_bytes = sum(layer.param_bytes for layer in [*self.layers, *after])
        self.param_tensors = sum(layer.param_tensors for layer in [*self.layers, *after])
        self.frozen_bytes = sum(layer.frozen_bytes for layer in [*self.layers, *after])
        self.largest_outside = max((o.bytes for o in share or () if o.trained), default=0)
        for o in share or ():
            self.param_bytes += o.bytes if o.trained else 0
            self.param_tensors += 1 if o.trained else 0
            self.frozen_bytes += 0 if o.trained else o.bytes
        self.forward_s = sum(layer.forward_s for layer in self.layers)
        self.backward_s = sum(layer.backward_s for layer in self.layers)
        self._memo: Dict[Tuple[Any, ...], Any] = {}

    def _once(self, key: Tuple[Any, ...], make: Callable[[], T]) -> T:
        """``make()``, once per ``key``: its answer is shared, so callers read it and never change it."""
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    def _crossing(self, boundary: int) -> int:
        """The bytes a pipeline_of model's stage boundary before layer ``boundary`` carries."""
        p = self.profile
        if p.handoffs is not None:
            return p.handoffs.bytes_crossing(boundary)
        return p.bytes_of({o for layer in p.layers[:boundary] for o in layer.outputs})

    def outside_share(self) -> Optional[Sequence[OutsideParam]]:
        """The parameters outside a ``pipeline_of`` model's layers this stage's rank holds under the
        distributed engine; None on the local engine (the last stage counts them) or for a Sequential."""
        p = self.profile
        if self.local or p.outside_params is None:
            return None
        return stage_share(p.outside_params, self.start, self.stop, self.last)

    def bytes(self, ids: Set[int]) -> int:
        return self.profile.bytes_of(ids if self.local else ids - self.inputs)

    def segments(self, mode: CheckpointMode, recompute: bool) -> List[Tuple[int, int]]:
        """The layer ranges (absolute) a micro-batch is checkpointed in: one segment of the whole
        stage, or runs of ``mode.every`` layers when it is recomputed granularly (pipeckpt/stages/stage.py
        ``_granular``: ``:k``, and ``+selective`` with or without ``:k``); a ``pipeline_of`` model's
        layers one by one, whatever the mode."""
        if not recompute or (mode.every is None and not mode.selective and not self.layer_calls):
            return [(self.start, self.stop)]
        every = 1 if self.layer_calls else mode.every or (self.stop - self.start)
        return [(a, min(a + every, self.stop)) for a in range(self.start, self.stop, every)]

    def _segment_input(self, a: int) -> Set[int]:
        return set(self.inputs) if a == self.start else set(self.profile.layers[a].inputs)

    def _kept_through(self, mode: CheckpointMode, segments: Sequence[Tuple[int, int]]) -> Set[int]:
        """What the checkpointed ``segments`` keep from forward to backward: each one's input and,
        selective, the outputs of the ops SAC keeps (pipeckpt/checkpointing/selective.py)."""
        held: Set[int] = set(self.inputs)
        for a, b in segments:
            held |= self._segment_input(a)
            if mode.selective:
                # SAC runs inside the stage's Function, which keeps the segment's input and output.
                held |= set(self.profile.layers[b - 1].outputs)
                for layer in self.profile.layers[a:b]:
                    held |= set(layer.sac_kept)
        return held

    def kept(
        self, mode: CheckpointMode, recompute: bool, *, function: bool = True, output: bool = False
    ) -> int:
        """Bytes one micro-batch holds from its forward to its backward (without the stage's
        Function, its output only where a layer saved it). ``output``: the stage's output is held
        besides (torch's PipelineStage keeps each micro-batch's output until its backward); a
        storage a layer also saves counts once."""
        return self.bytes(self.kept_ids(mode, recompute, function=function, output=output))

    def kept_ids(
        self, mode: CheckpointMode, recompute: bool, *, function: bool = True, output: bool = False
    ) -> Set[int]:
        """The storages :meth:`kept` counts (shared: read, never changed)."""
        return self._once(
            ("kept", mode, recompute, function, output),
            lambda: self._kept_ids(mode, recompute, function=function, output=output),
        )

    def _kept_ids(self, mode: CheckpointMode, recompute: bool, *, function: bool, output: bool) -> Set[int]:
        if not recompute:
            ids = self.profile.saved_union(self.start, self.stop)
            if function:
                ids |= self.outputs | self.inputs
        else:
            ids = self._kept_through(mode, self.segments(mode, recompute))
        return ids | self.outputs if output else ids

    def forward_live(self, mode: CheckpointMode, recompute: bool) -> List[Tuple[int, int]]:
        """(held by this micro-batch, the layer's own forward peak) while each layer runs forward:
        a kept micro-batch keeps what each layer saved; a recomputed one its segments' inputs (and
        selective, the outputs SAC keeps) so far (shared: read, never changed)."""
        return self._once(("forward", mode, recompute), lambda: self._forward_live(mode, recompute))

    def _forward_live(self, mode: CheckpointMode, recompute: bool) -> List[Tuple[int, int]]:
        out = []
        held: Set[int] = set(self.inputs)
        for a, b in self.segments(mode, recompute):
            held |= self._segment_input(a)
            for layer in self.profile.layers[a:b]:
                out.append((self.bytes(held | set(layer.inputs)), layer.forward_peak))
                if not recompute:
                    held |= set(layer.saved)
                elif mode.selective:
                    held |= set(layer.sac_kept)
            if recompute and mode.selective:
                held |= set(self.profile.layers[b - 1].outputs)
        return out

    def backward_events(
        self, mode: CheckpointMode, recompute: bool, *, function: bool = True, output: bool = False
    ) -> List[Tuple[Any, ...]]:
        """One micro-batch's backward, segment by segment from the last: a recomputed segment first
        runs forward again, ``("R", layer, held, forward peak)``, keeping what its layers save; then
        each layer's backward, last first, ``("B", layer, held, arriving, backward peak, grads of
        the stage's layers after it, last segment?, segment's last layer?)``. While a segment runs
        backward, the earlier segments still keep what they kept, and the segment's output and the
        gradient that arrived for it stay held: its Function's backward holds both while autograd
        runs inside it (whole stage: the stage's output and its incoming gradient). ``output``: the
        stage's output from the forward is held throughout besides (torch's PipelineStage): counted
        once with what holds it already, and apart from the new output a recompute makes (shared:
        read, never changed)."""
        return self._once(
            ("backward", mode, recompute, function, output),
            lambda: self._backward_events(mode, recompute, function=function, output=output),
        )

    def _backward_events(
        self, mode: CheckpointMode, recompute: bool, *, function: bool, output: bool
    ) -> List[Tuple[Any, ...]]:
        p = self.profile
        segments = self.segments(mode, recompute)
        outs: Set[int] = set()  # held from the forward: counted once with the rest
        extra = 0  # held from the forward beside a recompute's own copy
        if output and recompute:
            extra = self.bytes(self.outputs - self._kept_through(mode, segments))
        elif output:
            outs = set(self.outputs)
        out: List[Tuple[Any, ...]] = []
        for n in reversed(range(len(segments))):
            a, b = segments[n]
            if recompute:
                before = self._kept_through(mode, segments[: n + 1])
            else:  # the Function holds the stage's input; plain autograd only what a layer saved
                before = set(self.inputs) if function else set()
            if recompute:
                held = set(before)
                if mode.selective:
                    # SAC's cache hands each kept output to the recompute as its op runs again (and
                    # drops it there): the recompute keeps only what autograd saves, so an output
                    # still held is one of a layer not yet run again. The segment's output has gone
                    # before the recompute starts (the Function drops it) unless such a layer's op
                    # made it; its gradient is held instead (the walk adds it).
                    before = self._kept_through(mode, segments[:n]) | self._segment_input(a)
                    held = set(before)
                for k in range(a, b):
                    layer = p.layers[k]
                    work = layer.forward_peak
                    pending: Set[int] = set()  # SAC's kept outputs of this layer and the ones after it
                    if mode.selective:  # SAC hands back the outputs it kept instead of computing them
                        work = max(0, work - p.bytes_of(set(layer.sac_kept)))
                        pending = set().union(*(set(x.sac_kept) for x in p.layers[k:b]))
                    last_segment, seg_out = n == len(segments) - 1, p.bytes_of(set(p.layers[b - 1].outputs))
                    now = held | pending | set(layer.inputs)
                    out.append(("R", k, self.bytes(now) + extra, work, last_segment, seg_out))
                    held |= set(layer.saved)
            # Nothing holds the segment's output through its backward unless a layer saved it: the
            # stage's Function starts the backward inside from the output's gradient edge and drops
            # the output first (stages/recompute.py ``_Recompute._roots``); without the Function (one
            # kept micro-batch) autograd walks the graph itself.
            for k in reversed(range(a, b)):
                layer = p.layers[k]
                held = before | p.saved_union(a, k + 1)
                after = sum(x.param_bytes for x in p.layers[k + 1 : self.stop])
                own = p.bytes_of(set(layer.outputs))
                out.append(
                    (
                        "B",
                        k,
                        self.bytes(held | outs) + extra,
                        own,
                        layer.backward_peak,
                        after,
                        n == len(segments) - 1,
                        k == b - 1,
                        layer.largest_param,
                    )
                )
        return out

    def recompute_s(self, mode: CheckpointMode) -> float:
        """Seconds one recomputed micro-batch's forward takes again: the whole stage, or under
        selective all but the ops SAC kept."""
        if mode.selective:
            return sum(selective_extra_s(layer) for layer in self.layers)
        return self.forward_s


def between_passes(s: _StageModel, mode: CheckpointMode) -> int:
    """Bytes one micro-batch of stage ``s`` holds from a split backward's input pass to its weight pass
    (pipeckpt/stages/weight_pass.py): the graph its stage Function recomputed or kept, with every
    tensor its layers saved, and the gradients the input pass recorded for the weight pass, as
    the profile measured them per layer (every linear's output gradient, a norm's: 11.4x the
    layer's output on the benchmarks' HF Llama). A stage whose first layer's input needs no
    gradient (token ids) defers its whole backward: it holds the gradients that arrived for its
    outputs. Selective checkpointing does not split (torch's checkpoint recomputes once):
    nothing."""
    if mode.selective:
        return 0
    ids = s.profile.saved_union(s.start, s.stop)
    trained = [layer for layer in s.layers if layer.param_bytes]
    if s.layers and s.layers[0].split_whole:
        recorded = s.profile.bytes_of(set(s.layers[-1].outputs))
    else:
        recorded = sum(
            s.profile.bytes_of(set(layer.outputs)) if layer.split_held is None else layer.split_held
            for layer in trained
        )
    return s.bytes(ids) + recorded
