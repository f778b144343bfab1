"""Stages under the local engine: how often each stage runs, and that
checkpointing never changes the numbers."""

import threading
from typing import Dict, List

import pytest
import torch
from support.toy import Counter, toy_layers
from torch import nn

from pipeckpt import ALWAYS, NEVER, OFFLOAD
from pipeckpt.boundaries.pytrees import is_tensor_or_tensors as _tensor_or_tensors
from pipeckpt.checkpointing.modes import parse_modes
from pipeckpt.engines.local.pipeline import LocalPipeline
from pipeckpt.stages.caller import CallerState, StepCasts, capture_caller_state
from pipeckpt.stages.partition import plan
from pipeckpt.stages.stage import Stage

CPU = [torch.device("cpu")]
MIXES = ["never", "except_last", "always", "offload", ["always", "never", "except_last"]]


def counted(depth: int = 6, dropout: float = 0.3) -> nn.Sequential:
    """Layers with a Counter at the head of each of 3 stages of 2 layers."""
    torch.manual_seed(0)
    layers = list(toy_layers(depth=depth, dropout=dropout))
    return nn.Sequential(
        *[nn.Sequential(Counter(), layer) if i % 2 == 0 else layer for i, layer in enumerate(layers)]
    )


def run(mode, *, chunks: int = 4, batch: int = 8, seq: nn.Sequential = None) -> LocalPipeline:
    seq = seq if seq is not None else counted()
    engine = LocalPipeline(seq, plan(seq, devices=CPU, balance=[2, 2, 2], checkpoint=mode), chunks=chunks)
    torch.manual_seed(1)
    out = engine.forward(torch.randn(batch, 8, generator=torch.Generator().manual_seed(2)))
    out.pow(2).mean().backward()
    return engine


def counts(engine: LocalPipeline) -> List[int]:
    return [s.partition[0][0].calls for s in engine.stages]


@pytest.mark.parametrize(
    "mode, per_stage",
    [
        ("never", 4),
        ("except_last", 7),
        ("always", 8),
        ("offload", 8),
    ],
)
def test_each_stage_runs_forward_once_per_microbatch_plus_recomputes(mode, per_stage):
    assert counts(run(mode)) == [per_stage] * 3


def test_per_stage_modes_recompute_only_their_own_stage():
    assert counts(run(["always", "never", "except_last"])) == [8, 4, 7]


def test_no_recompute_without_grad():
    seq = counted()
    engine = LocalPipeline(seq, plan(seq, devices=CPU, balance=[2, 2, 2], checkpoint="always"), chunks=4)
    with torch.no_grad():
        engine.forward(torch.randn(8, 8))
    assert counts(engine) == [4, 4, 4]


def grads(engine: LocalPipeline) -> Dict[str, torch.Tensor]:
    seq = nn.Sequential(*[s.partition for s in engine.stages])
    return {k: p.grad.clone() for k, p in seq.named_parameters()}


@pytest.mark.parametrize("mode", MIXES[1:], ids=str)
def test_gradients_with_dropout_are_bitwise_equal_to_never(mode):
    reference, other = grads(run("never")), grads(run(mode))
    for k in reference:
        assert torch.equal(reference[k], other[k]), k


def test_recompute_leaves_batchnorm_running_statistics_as_never_does():
    def bn_layers() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 8), nn.BatchNorm1d(8))

    never, always = bn_layers(), bn_layers()
    for seq, mode in ((never, "never"), (always, "always")):
        engine = LocalPipeline(seq, plan(seq, devices=CPU, balance=[2, 2], checkpoint=mode), chunks=2)
        engine.forward(torch.randn(8, 8, generator=torch.Generator().manual_seed(3))).sum().backward()
    for a, b in zip(never.buffers(), always.buffers()):
        assert torch.equal(a, b)


def test_fewer_samples_than_chunks_runs_fewer_microbatches_with_a_warning():
    from pipeckpt import PipeckptWarning

    with pytest.warns(PipeckptWarning, match=r"a batch of 3 samples makes only 3 micro-batches for chunks=4"):
        engine = run("never", chunks=4, batch=3)
    assert counts(engine) == [3, 3, 3]


def test_a_flop_counter_around_the_pipeline_sees_every_stages_forward():
    from torch.utils.flop_counter import FlopCounterMode

    def flops(pipelined: bool) -> int:
        torch.manual_seed(0)
        seq = toy_layers(depth=6)
        x = torch.randn(8, 8)
        run_ = (
            LocalPipeline(
                seq, plan(seq, devices=CPU, balance=[2, 2, 2], checkpoint="never"), chunks=4
            ).forward
            if pipelined
            else seq
        )
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            run_(x)
        return counter.get_total_flops()

    assert flops(pipelined=True) == flops(pipelined=False) > 0


# -- one Stage alone: what the mutation run (docs/TESTING.md) showed no other test pinned down --------


def lone_stage(mode, partition: nn.Module = None, **kwargs) -> Stage:
    torch.manual_seed(0)
    partition = partition if partition is not None else nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    return Stage(partition, index=0, mode=mode, device=torch.device("cpu"), **kwargs)


@pytest.mark.parametrize("mode, runs", [("never", 4), ("except_last", 7), ("always", 8)])
def test_forward_calls_count_every_run_of_the_partition_recomputes_included(mode, runs):
    stage = lone_stage(parse_modes(mode, 1)[0])
    stage.begin_step(4)
    outputs = [stage(torch.randn(2, 8, requires_grad=True)) for _ in range(4)]
    torch.stack(outputs).sum().backward()
    assert stage.forward_calls == runs


def test_a_stage_pins_offloaded_inputs_by_default_and_names_itself():
    stage = lone_stage(OFFLOAD)
    assert stage.pin_memory is True
    assert stage.extra_repr() == "index=0, mode=offload, device=cpu"


def test_a_checkpointed_tuple_input_reaches_the_partition_as_that_tuple():
    class Add(nn.Module):
        def forward(self, pair):
            assert type(pair) is tuple and len(pair) == 2
            return pair[0] * pair[1]

    def grads(mode):
        stage = lone_stage(mode, Add())
        stage.begin_step(1)
        a, b = torch.full((2,), 2.0, requires_grad=True), torch.full((2,), 3.0, requires_grad=True)
        stage((a, b)).sum().backward()
        return a.grad, b.grad, stage.forward_calls

    a_grad, b_grad, runs = grads(ALWAYS)
    assert torch.equal(a_grad, torch.full((2,), 3.0)) and torch.equal(b_grad, torch.full((2,), 2.0))
    assert runs == 2  # the forward and its recompute


def test_a_checkpointed_output_of_a_tensor_and_none_comes_back_in_that_shape():
    class WithNone(nn.Module):
        def forward(self, x):
            return (x * 2, None)

    stage = lone_stage(ALWAYS, WithNone())
    stage.begin_step(1)
    x = torch.ones(2, requires_grad=True)
    out, nothing = stage(x)
    assert nothing is None and torch.equal(out, torch.full((2,), 2.0))
    out.sum().backward()
    assert torch.equal(x.grad, torch.full((2,), 2.0))


def test_an_integer_output_of_a_checkpointed_stage_is_not_differentiable():
    class ArgMax(nn.Module):
        def forward(self, x):
            return x.argmax(dim=-1)

    stage = lone_stage(ALWAYS, ArgMax())
    stage.begin_step(1)
    out = stage(torch.randn(2, 8, requires_grad=True))
    assert out.dtype == torch.int64 and not out.requires_grad


@pytest.mark.parametrize(
    "x, fast",
    [
        (torch.ones(1), True),
        ((torch.ones(1), torch.ones(1)), True),
        ((torch.ones(1),), True),
        ((), False),
        ([torch.ones(1)], False),
        ((torch.ones(1), 2), False),
        (2, False),
    ],
    ids=["tensor", "pair", "one-tuple", "empty-tuple", "list", "tuple-with-int", "int"],
)
def test_only_a_tensor_or_a_nonempty_tuple_of_tensors_takes_the_fast_path(x, fast):
    assert _tensor_or_tensors(x) is fast


def test_a_step_of_recomputes_is_done_after_exactly_its_count():
    step = StepCasts(remaining=2)
    assert [step.one_done(), step.one_done()] == [False, True]
    assert step.remaining == 0


def test_a_stage_alone_under_autocast_recomputes_in_bf16_and_lets_the_cast_cache_go():
    stage = lone_stage(ALWAYS, nn.Linear(8, 8))
    seen = []
    stage.partition.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    stage.begin_step(2)
    with torch.autocast("cpu", dtype=torch.float16):
        outputs = [stage(torch.randn(2, 8, requires_grad=True)) for _ in range(2)]
    torch.stack(outputs).float().sum().backward()
    assert seen == [torch.float16] * 4  # two forwards, two recomputes in the forward's dtype
    assert torch.autocast_increment_nesting() == 1  # no nesting level left held after the last
    torch.autocast_decrement_nesting()


def test_the_caller_state_is_applied_only_on_another_thread_and_only_if_there_is_one():
    empty = capture_caller_state()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        caller = capture_caller_state()
    assert caller.autocast == (("cpu", torch.bfloat16, True),) and caller.thread == threading.get_ident()
    assert empty.autocast == () and empty.dispatch_modes == ()
    here = [caller.needs_applying(), empty.needs_applying(), CallerState(thread=None).needs_applying()]
    there = []
    worker = threading.Thread(target=lambda: there.extend([caller.needs_applying(), empty.needs_applying()]))
    worker.start()
    worker.join()
    assert (here, there) == ([False, False, False], [True, False])


def test_a_stage_run_on_another_thread_runs_under_the_callers_autocast():
    from pipeckpt.stages.caller import capture_caller_state

    stage = lone_stage(NEVER, nn.Linear(8, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        stage.begin_step(1, capture_caller_state())
    out = []
    worker = threading.Thread(target=lambda: out.append(stage(torch.randn(2, 8))))
    worker.start()
    worker.join()
    assert out[0].dtype == torch.bfloat16


@pytest.mark.parametrize("mode", ["selective", "except_last", "always:1", "always"])
def test_an_input_a_hook_kept_carries_no_gradient_after_the_stage_backward(mode: str) -> None:
    # A stage's input is a leaf of its micro-batch's own graph; its gradient goes back to the stage
    # before. Left on the leaf, it would live as long as anything holds the leaf (here a forward
    # pre-hook; torch's MemTracker does so for every layer's input).
    seq = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)])
    stages = plan(seq, devices=[torch.device("cpu")], balance=[2, 2], checkpoint=mode)
    engine = LocalPipeline(seq, stages, chunks=2)
    kept: List[torch.Tensor] = []
    seq[2].register_forward_pre_hook(lambda module, args: kept.append(args[0]))
    engine.forward(torch.randn(4, 8, requires_grad=True)).sum().backward()
    assert kept and all(x.grad is None for x in kept)


def test_a_stage_with_nothing_between_a_microbatch_and_its_layers_hands_it_straight_to_them(monkeypatch):
    stage = lone_stage(NEVER)
    stage.backward_per_microbatch = True  # each micro-batch's backward its own: no Function to order them
    stage.begin_step(1)
    stage(torch.randn(2, 8))  # the first step with gradients checks for escaping tensors (stages/escapes.py)
    stage.begin_step(3)
    calls = stage.forward_calls

    def checked(*args):
        raise AssertionError("the micro-batch went through forward's checks")

    monkeypatch.setattr(stage, "_forward", checked)
    x = torch.randn(2, 8)
    assert all(torch.equal(stage(x), stage.partition(x)) for _ in range(3))
    assert (stage.next_microbatch, stage.forward_calls - calls) == (3, 3)


@pytest.mark.parametrize("what", ["checkpointing", "autocast on the caller's thread", "ordered gradients"])
def test_a_stage_with_something_between_a_microbatch_and_its_layers_runs_forwards_checks(what, monkeypatch):
    stage = lone_stage(ALWAYS if what == "checkpointing" else NEVER)
    stage.backward_per_microbatch = what != "ordered gradients"
    caller = (
        CallerState(autocast=(("cpu", torch.bfloat16, True),))
        if what.startswith("autocast")
        else CallerState()
    )
    stage.begin_step(2, caller)
    seen = []
    forward = stage._forward
    monkeypatch.setattr(stage, "_forward", lambda *args: seen.append(args[0]) or forward(*args))
    [stage(torch.randn(2, 8, requires_grad=True)) for _ in range(2)]
    assert seen == [0, 1]


def test_a_stage_plans_its_step_afresh_when_its_mode_changes_between_steps():
    stage = lone_stage(NEVER)
    runs = []
    for mode in (NEVER, ALWAYS, NEVER):
        stage.mode, calls = mode, stage.forward_calls
        stage.begin_step(2)
        torch.stack([stage(torch.randn(2, 8, requires_grad=True)) for _ in range(2)]).sum().backward()
        runs.append(stage.forward_calls - calls)
    assert runs == [2, 4, 2]  # always recomputes both micro-batches
