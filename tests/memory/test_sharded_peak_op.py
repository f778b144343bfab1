"""A rank's peak falls at the op where its own shares make the most, not where the whole stage's
do (pipeckpt/memory/stage_memory.py, ``StageMemory.candidates``; memory/rank_peak.py, ``per_rank``).

Unsharded, a stage whose parameters outweigh its activations peaks at the optimizer step (every
gradient beside the optimizer state); sharded 64 ways, the same stage peaks in a backward, where the
activations are, or at the step's deferred reduction, where every unit's whole gradient is held. Read
at the whole stage's op, Llama 3.1 405B at pp1 x fsdp256 was planned at 61 GiB a rank with no
activations at all, and the layout search picked it without recompute."""

import torch

from pipeckpt.app.models.llama import llama_config, llama_layers
from pipeckpt.memory.predict import predict
from pipeckpt.memory.profile import profile
from pipeckpt.memory.rank_peak import REDUCING, _at, before_gradients, per_rank, stage_orders
from pipeckpt.memory.sharding import Layout, rank_state, reduced_in_backward
from pipeckpt.stages.partition import plan


def _stage():  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    layers = llama_layers(llama_config("tiny", seq_len=16))
    fitted = profile(layers, torch.randint(256, (2, 16)), fake=True)
    p = plan(layers, devices=["cpu"], stages=1, checkpoint="never", chunks=1)
    return layers, predict(fitted, p, chunks=1, optimizer="adamw", schedule="gpipe").stages[0]


def test_unsharded_the_tiny_llamas_stage_peaks_at_its_optimizer_step() -> None:
    _, stage = _stage()
    assert stage.peak_at == "optimizer step" and stage.activations == 0


def test_sharded_its_rank_peaks_where_its_own_shares_make_the_most() -> None:
    """64 ways sharded, the optimizer step holds little (shards of the state and the gradients), the
    backward the activations, and the step's deferred reduction every unit's whole gradient (torch's
    PipelineStage reduces them once, at the step's end): the largest of the three is the rank's."""
    layers, stage = _stage()
    state = rank_state(list(layers), Layout(fsdp=64, precision="bf16-mixed"), "adamw")
    rank = per_rank(stage, state)
    first = stage.candidates[0]
    assert first[4] == "B0 layer 3" and first[1] > 0
    backward = _at(stage, state, first, first[1] + first[2] + first[3])
    step = rank.state.params + state.grads + state.optimizer + stage.working  # nothing gathered then
    assert backward.peak > step
    assert rank.peak_at == REDUCING and rank.state.grads == state.grads_backward
    whole = state.params + state.grads_backward + state.optimizer + state.unsharded + state.reducing
    assert rank.peak == whole > backward.peak


def test_a_stage_of_one_micro_batch_a_step_reduces_in_its_backward_and_holds_shards() -> None:
    """The engine lets FSDP2 reduce-scatter in the backward of a stage that runs one micro-batch a
    step (engines/distributed/wiring.py): no whole gradients, no step's reduction."""
    layers, stage = _stage()  # one micro-batch, GPipe
    state = rank_state(list(layers), Layout(fsdp=64, precision="bf16-mixed"), "adamw")
    (order,) = stage_orders("gpipe", 1, 1)
    rank = per_rank(stage, state, order)
    assert rank.peak_at != REDUCING and rank.state.grads <= state.grads
    assert rank == per_rank(stage, reduced_in_backward(state))
    assert per_rank(stage, state, stage_orders("gpipe", 1, 2)[0]).peak_at == REDUCING  # two: deferred


def test_the_ranks_peak_is_the_largest_of_the_candidates_with_its_shares() -> None:
    layers, stage = _stage()
    state = rank_state(list(layers), Layout(fsdp=64, precision="bf16-mixed"), "adamw")
    trained = stage.params - stage.frozen
    totals = []
    for held, acts, boundary, working, at in stage.candidates:
        if at == "optimizer step":  # FSDP2 has reduced, resharded every unit and freed its buffers
            grads = round(held / trained * state.grads)
            totals.append(acts + boundary + working + state.params + grads + state.optimizer)
            continue
        grads = round(held / trained * state.grads_backward)  # whole until the step reduces them
        collectives = state.collectives if held or not before_gradients(at) else 0
        totals.append(
            acts + boundary + working + state.params + grads + state.optimizer + state.unsharded + collectives
        )
    assert len(stage.candidates) > 2  # none, some and every gradient held
    totals.append(state.params + state.grads_backward + state.optimizer + state.unsharded + state.reducing)
    assert per_rank(stage, state).peak == max(totals)


def test_under_reshard_after_forward_a_backward_keeps_the_units_it_has_gathered() -> None:
    """torch's PipelineStage keeps FSDP2 from resharding after each backward until the step's
    reduce_grad: in the backward the units whose gradients it holds stay gathered beside the running
    and the prefetched one; in a forward only those two; at the loss before any backward none (every
    unit was resharded after its forward)."""
    layers, stage = _stage()
    kept = rank_state(list(layers), Layout(fsdp=4, precision="bf16-mixed"), "adamw")
    freed = rank_state(
        list(layers), Layout(fsdp=4, precision="bf16-mixed", reshard_after_forward=True), "adamw"
    )
    assert freed.unsharded < kept.unsharded == freed.unsharded_backward
    assert kept.unsharded_backward is None
    gaps = set()
    for c in stage.candidates:
        at, held = c[4], c[0]
        if at == "optimizer step":
            continue
        rest = c[1] + c[2] + c[3]
        share = held / (stage.params - stage.frozen)
        backward = held or not before_gradients(at)
        again = min(kept.unsharded, round(share * kept.unsharded) + freed.unsharded)
        before = 0 if at.endswith(" loss") else freed.unsharded
        gap = kept.unsharded - (again if backward else before)
        gaps.add(gap)
        assert _held(stage, kept, c, rest) - _held(stage, freed, c, rest) == gap, at
    assert len(gaps) > 2  # the loss, a backward part done, one all but done


def test_under_reshard_after_forward_nothing_is_gathered_at_the_first_loss() -> None:
    """A ``pipeline_of`` stage's walk has its loss as an op of its own (this Sequential's last layer
    computes it): before the first backward, every unit, the head among them, was resharded after
    its forward; the walk's other ops before any gradient (a forward) hold the running and the
    prefetched unit."""
    layers, stage = _stage()
    freed = rank_state(
        list(layers), Layout(fsdp=4, precision="bf16-mixed", reshard_after_forward=True), "adamw"
    )
    for at, gathered in [("B0 loss", 0), ("stage 1 F2 loss", 0), ("F0 layer 1", freed.unsharded)]:
        assert _at(stage, freed, (0, 100, 10, 1, at), 111).state.unsharded == gathered, at
    assert freed.unsharded > 0


def _held(stage, state, candidate, rest):  # type: ignore[no-untyped-def]
    return _at(stage, state, candidate, rest).peak
