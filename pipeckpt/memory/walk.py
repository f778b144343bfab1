"""The walk over one stage's ops that finds its peak: what it holds between ops, and the totals
while each op runs, layer by layer.

Why a walk and not a formula: which micro-batches are in flight, which recompute, and which
gradients and sends are alive all change op by op with the schedule, and the peak can fall in any
layer of any op. :mod:`pipeckpt.memory.predict` runs one walk per stage (or, on a device with
several stages, all of them interleaved). docs/MEMORY.md, "memory/walk.py", says what each op holds.
"""

from typing import AbstractSet, Dict, List, Optional, Sequence, Tuple, Union

import torch

from pipeckpt.checkpointing.modes import CheckpointMode
from pipeckpt.memory.engine_cost import engine_s_per_microbatch
from pipeckpt.memory.optimizer_state import optimizer_state_bytes, optimizer_step_bytes
from pipeckpt.memory.profile import LayerProfile
from pipeckpt.memory.stage_memory import StageMemory, _Peak
from pipeckpt.memory.stage_model import _StageModel, between_passes

__all__ = ["StageMemory"]


def _predict_stage(
    s: _StageModel,
    j: int,
    mode: CheckpointMode,
    ops: List[Tuple[str, int]],
    *,
    chunks: int,
    keep: AbstractSet[int],
    optimizer: Union[str, torch.optim.Optimizer, type],
    accumulating: bool,
    sends: Optional[Sequence[Tuple[int, int]]] = None,
    stale_grads: bool = False,
) -> StageMemory:
    """Walks the stage through its ops, keeping the largest total seen. ``keep``: the micro-batches
    ``except_last`` keeps under this schedule (``checkpointing.order.kept`` of the stage's order);
    ``sends``: per op, the outputs and input gradients sends still hold
    (:func:`~pipeckpt.memory.schedule.sends_held`); ``stale_grads``: the previous step's gradients
    stay until the first backward (Lightning zeroes them after ``training_step``)."""
    walk = _StageWalk(
        s,
        j,
        mode,
        chunks=chunks,
        keep=keep,
        optimizer=optimizer,
        accumulating=accumulating,
        stale_grads=stale_grads,
    )
    for n, (kind, i) in enumerate(ops):
        walk.run(kind, i, sent=sends[n] if sends is not None else (0, 0))
    walk.step()
    return _result(walk)


class _StageWalk:
    """One stage's memory, op by op: what it holds between ops (:meth:`resting`) and the totals
    while one of its ops runs (:meth:`run`), seen by its own peak and, where several stages share
    a device, by the device's (``around``: what the device's other stages hold meanwhile)."""

    def __init__(
        self,
        s: _StageModel,
        j: int,
        mode: CheckpointMode,
        *,
        chunks: int,
        keep: AbstractSet[int],
        optimizer: Union[str, torch.optim.Optimizer, type],
        accumulating: bool,
        stale_grads: bool = False,
    ) -> None:
        self.s, self.j, self.mode, self.m, self.keep = s, j, mode, chunks, keep
        m, local = chunks, s.local
        self.grads = s.param_bytes
        self.opt = optimizer_state_bytes(optimizer, s.param_bytes, s.param_tensors)
        self.params = s.param_bytes + s.frozen_bytes  # held all step (a rank's share: predict._on_rank)
        self.static = self.params + self.opt
        after = (
            [s.profile.loss] if s.last and s.profile.loss is not None and s.outside_share() is None else []
        )
        largest = max((layer.largest_param for layer in [*s.layers, *after]), default=s.largest_outside)
        largest = max(largest, s.largest_outside)
        self.step_work = optimizer_step_bytes(optimizer, largest)
        # A pipeline_of model on the local engine runs its code outside the layers per micro-batch
        # (engines/local/module.py): the head after the last stage's forward and before its backward,
        # the embeddings' backward after the first stage's; its micro-batches run depth first.
        outside = s.profile.outside if local else None
        self.rooted = outside is not None
        self.outside = outside if s.last else None
        self.embeddings = outside.before_backward if outside is not None and s.first else 0
        self.head_grads = self.outside.after_grads if self.outside is not None else 0
        self.loss = s.profile.loss if s.last and not self.rooted else None
        # torch's PipelineStage keeps each micro-batch's output until its backward: on a pipeline_of
        # model's last stage (distributed), the model's own outputs (its logits), beside what its loss saves.
        kept = set(self.loss.outputs) if self.loss is not None and s.profile.outside is not None else set()
        self.loss_saved = s.profile.bytes_of(set(self.loss.saved) | kept) if self.loss is not None else 0
        # The distributed engine: torch's PipelineStage keeps a receive buffer per micro-batch for
        # activations and gradients (_StageModel.received_bytes, returned_bytes), and each
        # micro-batch's output until its backward.
        self.recv = 0 if local else m * (s.received_bytes + s.returned_bytes)
        # One micro-batch that is not recomputed runs without the stage's Function (stages/recompute.py).
        self.function = {r: r or m > 1 for r in (False, True)}
        self.kept_ids_of = {
            r: s.kept_ids(mode, r, function=self.function[r], output=not local) for r in (False, True)
        }
        self.kept_of = {r: s.bytes(ids) for r, ids in self.kept_ids_of.items()}
        self.forward = {r: s.forward_live(mode, r) for r in (False, True)}
        self.backward = {
            r: s.backward_events(mode, r, function=self.function[r], output=not local) for r in (False, True)
        }
        # The gradient arriving for the stage's output: the receive buffer (distributed, counted in
        # recv), a view of the gathered batch's (local, last stage: the tail, freed with the last
        # micro-batch's view); else a copy of its own. It stays held while the stage's last
        # segment runs backward; an earlier segment holds the gradient the segment after it made.
        self.stage_incoming = 0 if s.last == local and not self.rooted else s.output_bytes
        self.cells: Dict[int, int] = {}  # micro-batch -> bytes it holds until its backward
        self.peak, self.most = _Peak(), 0
        self.grads_done = accumulating or stale_grads
        self.stale = stale_grads and not accumulating  # gradients zeroed when the first backward starts
        self.tail = 0  # local engine, last stage: the gathered batch's output gradient
        self.device: Optional[_Peak] = None
        self.around = 0
        self.backwards = 0  # micro-batches whose backward is over
        self.hold_sends = False  # every send lives until the step ends (a looped schedule's)
        self.split: AbstractSet[int] = frozenset()  # micro-batches whose "B" is an input pass, a "W" after
        self.grad_share = 1.0  # of each layer's gradient, what one rank holds (predict._on_rank)

    def resting(self) -> int:
        """Bytes the stage holds while another stage of its device runs."""
        g_now = self.grads if self.grads_done else 0
        resting = self.static + g_now + self.recv + sum(self.cells.values()) + self.tail
        return resting + self._sent_bytes(self._held_sends())

    def _held_sends(self) -> Tuple[int, int]:
        return (self.backwards, self.backwards) if self.hold_sends else (0, 0)

    def _sent_bytes(self, sent: Tuple[int, int]) -> int:
        outputs, gradients = sent
        return outputs * (0 if self.s.last else self.s.output_bytes) + gradients * self.s.received_bytes

    def _see(self, value: int, parts: Tuple[int, int, int], at: str) -> None:
        self.peak.see(value, parts, at)
        if self.device is not None:
            self.device.see(value + self.around, parts, f"stage {self.j} {at}")

    def run(
        self,
        kind: str,
        i: int,
        *,
        sent: Tuple[int, int] = (0, 0),
        device: Optional[_Peak] = None,
        around: int = 0,
    ) -> None:
        """One op, ``("F" | "B", micro-batch)``. ``sent``: the outputs and input gradients of
        finished micro-batches the schedule's sends still hold
        (:func:`~pipeckpt.memory.schedule.sends_held`)."""
        s, mode, m, local, loss = self.s, self.mode, self.m, self.s.local, self.loss
        self.device, self.around = device, around
        static, recv, grads, cells, peak_see = self.static, self.recv, self.grads, self.cells, self._see
        recompute = mode.recomputes(i, m, keep=self.keep)
        if self.stale and kind != "F":
            self.grads_done = self.stale = False
        g_now = grads if self.grads_done else 0
        others = sum(cells.values())
        if self.hold_sends:
            sent = self._held_sends()
        recv_now = recv + self._sent_bytes(sent)  # the receive buffers, and what earlier sends still hold
        base = static + g_now + recv_now + others
        if kind == "W":  # what the input pass left: the weights' gradients, from the graph it held
            cells.pop(i, None)
            work = max((_weight_work(layer) for layer in s.layers), default=0)
            peak_see(base - g_now + grads + work, (others, recv_now, work), f"W{i}")
            self.grads_done = True
            return
        if kind == "F":
            # torchgpipe's clock: the next stage takes micro-batch i - 1's output one clock later,
            # after this stage's forward of micro-batch i; the last stage's wait for the gather.
            waiting = (i if s.last else min(i, 1)) * s.output_bytes if local and not self.rooted else 0
            for k, (mine, work) in enumerate(self.forward[recompute]):
                parts = (others + mine, recv_now + waiting, work)
                peak_see(base + waiting + mine + work, parts, f"F{i} layer {s.start + k}")
            cells[i] = self.kept_of[recompute]
            if self.outside is not None:  # the head and loss on this micro-batch, its outputs kept
                o = self.outside
                parts = (others + cells[i], recv_now, o.after_forward)
                peak_see(base + cells[i] + o.after_forward, parts, f"F{i} outside")
                cells[i] += o.held + o.outputs
                if not s.outputs <= self.kept_ids_of[recompute]:  # the head saved what the stage did not
                    cells[i] += o.input_saved
            if loss is not None and not local:  # torch computes each micro-batch's loss at once
                peak_see(
                    base + cells[i] + loss.forward_peak,
                    (others + cells[i], recv_now, loss.forward_peak),
                    f"F{i} loss",
                )
                cells[i] += self.loss_saved
            self.most = max(self.most, len(cells))
            if self.outside is not None and len(cells) == m:
                # The outputs joined (a copy of them all where there are several), then dropped.
                acts, joined = sum(cells.values()), m * self.outside.outputs if m > 1 else 0
                peak_see(static + g_now + acts + joined, (acts, joined, 0), "gather")
                for k in cells:
                    cells[k] -= self.outside.outputs
                return
            if local and s.last and len(cells) == m:
                self.tail = _whole_batch(self, recompute, static + g_now)
            return
        kept = cells.pop(i)
        base -= kept
        if local and self.backwards and not self.rooted:
            # The input gradient the previous backward (micro-batch i + 1) made waits in autograd's
            # buffer for the stage before until this backward is over: on one autograd pass, the
            # engine runs the nodes made later first, and this stage's forward of micro-batch i
            # came after the previous stage's of micro-batch i + 1 (torchgpipe's clock).
            recv_now += s.input_bytes
            base += s.input_bytes
        others = sum(cells.values())
        if self.outside is not None:  # after the first, each adds to the head's gradients out of place
            o = self.outside
            work = max(o.after_backward, o.after_left + o.after_grads) if self.backwards else o.after_backward
            peak_see(base + kept + work, (others + kept, recv_now, work), f"B{i} outside")
        if loss is not None and not local:
            peak_see(
                base + kept + loss.backward_peak, (others + kept, recv_now, loss.backward_peak), f"B{i} loss"
            )
        done = 0  # layers of this micro-batch backwarded so far
        function = self.function[recompute]
        for event in self.backward[recompute]:
            # The tail goes with the last micro-batch's view of it: under the stage's Function, when
            # the last segment's backward returns (autograd's engine holds the gradient it hands a
            # Function until then); in plain autograd, once the last layer's node has used it.
            if not cells and (not event[4 if event[0] == "R" else 6] if function else done == 1):
                self.tail = 0
            if event[0] == "R":
                # The gradient for the segment's output has arrived before its recompute starts.
                _, k, mine, work, last_segment, seg_out = event
                incoming = self.stage_incoming if last_segment else seg_out
                peak_see(
                    base + self.tail + incoming + mine + work,
                    (others + mine, recv_now + self.tail + incoming, work),
                    f"B{i} recompute layer {k}",
                )
                continue
            _, k, saved, own, work, after, last_segment, segment_end, _ = event
            # Before the stage's first backward ends, its gradients are those of the layers after k
            # and, on the last stage, those the head's backward made (a pipeline_of model's own).
            g = grads if self.grads_done else round(self.grad_share * after) + self.head_grads
            # Each micro-batch adds its gradients into .grad in place (pipeckpt/stages/stage.py), so
            # no sum over micro-batches waits beside .grad.
            incoming = (
                self.stage_incoming if last_segment else s.profile.bytes_of(set(s.profile.layers[k].outputs))
            )
            if not function:  # each gradient goes once its node has used it
                # The stage's last layer gets the stage's incoming gradient (the tail's view, which
                # the tail counts, on the local engine's last stage).
                arriving = incoming if last_segment and segment_end else own
            elif segment_end:
                arriving = incoming
            else:
                arriving = own + incoming
            if function and segment_end:
                # The Function holds the gradient for the segment's output through the whole
                # backward inside it, beyond the layer's first node (plain autograd frees it there).
                held_peak = s.profile.layers[k].backward_held_peak
                work = work if held_peak is None else held_peak
            first = s.profile.layers[k].first_backward_peak
            if not self.grads_done and first is not None:
                # The step's first backward of the layer keeps each weight gradient it makes.
                work = max(work, first)
            total = static + recv_now + others + g + saved + self.tail + arriving + work
            parts = (others + saved, recv_now + self.tail + arriving, work)
            peak_see(total, parts, f"B{i} layer {k}")
            done += 1
        self.grads_done = True
        if self.embeddings:  # the embeddings' backward, every gradient of the stage made
            # Gradients only the embeddings make (counted with the model's, on the last stage) are
            # not there yet in the first micro-batch's backward; each later one's is summed beside them.
            own = self.s.profile.outside.before_grads if self.s.profile.outside is not None else 0
            work = self.embeddings + (own if self.backwards else -own)
            total = static + recv_now + others + grads + work
            peak_see(total, (others, recv_now, work), f"B{i} embeddings")
        self.backwards += 1
        if i in self.split:
            cells[i] = between_passes(s, mode)

    def step(self, *, device: Optional[_Peak] = None, around: int = 0) -> None:
        """The optimizer's step after the last backward: every gradient made, the step's own
        temporaries beside them (:func:`optimizer_step_bytes`)."""
        self.device, self.around = device, around
        self._see(self.resting() + self.step_work, (0, 0, self.step_work), "optimizer step")


def _weight_work(layer: LayerProfile) -> int:
    """What a layer's weight pass allocates at once, as the profile measured it; a whole backward's
    peak where it did not (a bound: a weight pass makes no input gradients)."""
    return layer.backward_peak if layer.weight_pass_peak is None else layer.weight_pass_peak


def _whole_batch(walk: _StageWalk, recompute: bool, held: int) -> int:
    """The local engine's last stage once every micro-batch's forward is done: the whole batch at
    once, gathered outputs, loss forward and backward, beside ``held`` (the stage's state and
    gradients); returns the gathered batch's output gradient, which the stage holds on (the tail)."""
    s, m, loss, see = walk.s, walk.m, walk.loss, walk._see
    acts, gathered = sum(walk.cells.values()), m * s.output_bytes
    total = held + acts
    # One micro-batch is handed back as it is, no copy (LocalPipeline._gather): the output, and
    # what the loss saves of it, count once with what the micro-batch holds.
    kept = walk.kept_ids_of[recompute] if m == 1 else set()
    joined = s.bytes(s.outputs - kept) if m == 1 else 2 * gathered
    see(total + joined, (acts, joined, 0), "gather")
    if loss is not None:
        joined = s.bytes(s.outputs - kept) if m == 1 else gathered
        work = m * loss.forward_peak
        see(total + joined + work, (acts, joined, work), "loss forward")
        work = m * loss.backward_peak
        saved = s.profile.bytes_of(set(loss.saved) - kept) if m == 1 else m * walk.loss_saved
        see(total + saved + work, (acts, saved, work), "loss backward")
    return gathered


def _result(walk: _StageWalk) -> StageMemory:
    """The stage's memory and time once its walk is over."""
    s, mode, m, keep, peak = walk.s, walk.mode, walk.m, walk.keep, walk.peak
    acts, boundary, working = peak.parts
    held_grads = peak.value - walk.static - acts - boundary - working  # the rest of every total
    recomputed = sum(1 for i in range(m) if mode.recomputes(i, m, keep=keep))
    time_s = sum(_op_times(s, mode, m, keep).values())
    return StageMemory(
        stage=walk.j,
        layers=(s.start, s.stop),
        mode=mode.name,
        params=walk.params,
        frozen=s.frozen_bytes,
        grads=held_grads,
        optimizer=walk.opt,
        activations=acts,
        boundary=boundary,
        working=working,
        peak=peak.value,
        in_flight=walk.most,
        recomputed=recomputed,
        time_s=time_s,
        peak_at=peak.at,
        candidates=peak.candidates(walk.static),
    )


def _op_times(
    s: _StageModel, mode: CheckpointMode, m: int, keep: AbstractSet[int]
) -> Dict[Tuple[str, int], float]:
    loss = s.profile.loss if s.last else None
    lf = loss.forward_s if loss is not None else 0.0
    lb = loss.backward_s if loss is not None else 0.0
    e = engine_s_per_microbatch(s.local) / 2  # the engine's own, half with each pass (memory/engine_cost)
    out = {}
    for i in range(m):
        out[("F", i)] = s.forward_s + lf + e
        out[("B", i)] = (
            s.backward_s + lb + e + (s.recompute_s(mode) if mode.recomputes(i, m, keep=keep) else 0.0)
        )
    return out
