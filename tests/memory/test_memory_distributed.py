"""The memory model's rules for the distributed engine (torch's GPipe and 1F1B), apart from measurement.

Measured against the model in tests/bench_smoke/test_bench_distributed_memory_smoke.py (two gloo processes)
and
benchmarks/bench_distributed_memory.py; here each rule the model adds for torch's schedules is
pinned on its own: which sends still hold a tensor during each op, and how a stage's output, which
torch's PipelineStage holds until the micro-batch's backward, adds to what the micro-batch keeps;
and a device that runs several stages (a looped schedule) holds the others' while one runs.
"""

import pytest
import torch
import torch.nn.functional as F

from pipeckpt._errors import PipeckptConfigError
from pipeckpt.app.models.mlp import mlp_layers
from pipeckpt.checkpointing.modes import parse_modes
from pipeckpt.checkpointing.order import gpipe_order
from pipeckpt.memory.predict import predict, predict_device
from pipeckpt.memory.profile import profile
from pipeckpt.memory.schedule import op_order, sends_held
from pipeckpt.memory.stage_model import _StageModel, between_passes
from pipeckpt.stages.partition import StagePlan


def _ops(schedule: str, stage: int, *, stages: int = 2, m: int = 4):
    return op_order(schedule, stages=stages, microbatches=m)[0][stage]


def test_gpipe_holds_every_earlier_output_and_gradient_sent_until_the_step_ends() -> None:
    ops = _ops("gpipe", 1)
    assert ops == [("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 0), ("B", 1), ("B", 2), ("B", 3)]
    assert sends_held("gpipe", ops, stages=2, stage=1) == [(0, 0)] * 4 + [(0, 0), (1, 1), (2, 2), (3, 3)]


def test_1f1b_holds_one_warm_up_output_until_its_steady_phase_ends_and_the_latest_gradient() -> None:
    ops = _ops("1f1b", 0)
    assert ops == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("B", 3)]
    # Warm-up of two: micro-batch 0's output send stays referenced through B2 (the backward after
    # the last forward), beside the latest backward's gradient send from B0 on.
    assert sends_held("1f1b", ops, stages=2, stage=0) == [
        (0, 0),
        (0, 0),
        (0, 0),
        (1, 1),
        (1, 1),
        (1, 1),
        (1, 1),
        (0, 1),
    ]


def test_1f1b_with_a_warm_up_of_one_holds_no_output_send() -> None:
    ops = _ops("1f1b", 1)
    assert ops == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2), ("F", 3), ("B", 3)]
    assert sends_held("1f1b", ops, stages=2, stage=1) == [(0, 0), (0, 0)] + [(0, 1)] * 6


def test_the_local_engine_holds_no_send() -> None:
    ops = _ops("local", 0)
    assert sends_held("local", ops, stages=2, stage=0) == [(0, 0)] * 8


def _first_stage() -> _StageModel:
    """The first stage of an MLP, ``Linear, ReLU, Linear, ReLU``: its output is what the last ReLU saves."""
    torch.manual_seed(0)
    layers = mlp_layers(in_features=16, hidden=32, depth=3, num_classes=4)
    x, y = torch.randn(8, 16), torch.randint(4, (8,))
    fitted = profile(layers, x, loss_fn=F.cross_entropy, target=y, rounds=1)
    return _StageModel(fitted, 0, 4, first=True, last=False, local=False)


def test_a_kept_micro_batch_counts_the_output_its_last_layer_saves_once() -> None:
    stage = _first_stage()
    never = parse_modes("never", 1)[0]
    assert stage.kept(never, False, output=True) == stage.kept(never, False)


def test_a_recomputed_micro_batch_keeps_its_output_beside_its_input() -> None:
    stage = _first_stage()
    always = parse_modes("always", 1)[0]
    assert stage.output_bytes == 8 * 32 * 4 > 0
    assert stage.kept(always, True, output=True) == stage.kept(always, True) + stage.output_bytes


def test_a_recompute_runs_beside_the_output_of_the_forward() -> None:
    # The recompute makes a new output; the forward's, which torch's stage holds, stays beside it.
    stage = _first_stage()
    always = parse_modes("always", 1)[0]
    plain = stage.backward_events(always, True)
    held = stage.backward_events(always, True, output=True)
    assert [e[2] + stage.output_bytes for e in plain] == [e[2] for e in held]


def test_a_kept_micro_batchs_backward_counts_the_held_output_once_and_to_the_end() -> None:
    stage = _first_stage()
    never = parse_modes("never", 1)[0]
    plain = stage.backward_events(never, False)
    held = stage.backward_events(never, False, output=True)
    # Backward runs the last ReLU first, which saved the output: counted once there. After it, the
    # stage's Function no longer holds the output (pipeckpt/stages/recompute.py drops it before the backward
    # inside), but torch's PipelineStage does, until the micro-batch's backward ends.
    assert [e[1] for e in held] == [3, 2, 1, 0]
    assert [h[2] - p[2] for p, h in zip(plain, held)] == [0] + [stage.output_bytes] * 3


def _mlp_plan(balance, mode: str = "always"):
    torch.manual_seed(0)
    layers = mlp_layers(in_features=16, hidden=32, depth=4, num_classes=4)
    x, y = torch.randn(8, 16), torch.randint(4, (8,))
    fitted = profile(layers, x, loss_fn=F.cross_entropy, target=y, rounds=1)
    stage_plan = StagePlan(
        balance=tuple(balance),
        devices=(torch.device("cpu"),) * len(balance),
        modes=parse_modes(mode, len(balance)),
    )
    return fitted, stage_plan


def test_a_device_with_one_stage_in_gpipes_order_is_predicted_as_that_gpipe_stage() -> None:
    # GPipe keeps every send to the step's end, as a looped schedule's device does.
    fitted, stage_plan = _mlp_plan([4, 5])
    alone = predict(fitted, stage_plan, chunks=4, optimizer="adamw", schedule="gpipe").stages[1]
    device = predict_device(fitted, stage_plan, chunks=4, order=gpipe_order(1, 4), optimizer="adamw")
    assert (device.peak, device.params, device.optimizer) == (alone.peak, alone.params, alone.optimizer)


def test_a_device_holds_its_other_stage_while_one_runs() -> None:
    fitted, stage_plan = _mlp_plan([2, 2, 2, 3])
    first, second = gpipe_order(0, 4), gpipe_order(2, 4)
    device = predict_device(fitted, stage_plan, chunks=4, order=first + second, optimizer="sgd")
    alone = predict_device(fitted, stage_plan, chunks=4, order=second, optimizer="sgd")
    # Stage 0 is done when stage 2 starts: its parameters and gradients stay (sgd: no state).
    assert device.peak >= alone.peak + 2 * device.stages[0].params
    assert device.peak_at.startswith("stage 2")


def _split(j: int, m: int):
    """Stage ``j``'s forwards, then each micro-batch's input pass, then the weight passes."""
    return [(j, kind, i) for kind in ("F", "I", "W") for i in range(m)]


@pytest.mark.parametrize("mode", ["never", "always"])
def test_a_split_backward_holds_each_microbatchs_graph_from_its_input_pass_to_its_weight_pass(mode) -> None:
    fitted, stage_plan = _mlp_plan([4, 5], mode=mode)
    whole = predict_device(fitted, stage_plan, chunks=4, order=gpipe_order(1, 4), optimizer="sgd")
    split = predict_device(fitted, stage_plan, chunks=4, order=_split(1, 4), optimizer="sgd")
    held = between_passes(_StageModel(fitted, 4, 9, first=False, last=True, local=False), stage_plan.modes[1])
    # After the input passes every micro-batch's graph waits for its weight pass, which a whole
    # backward would have freed (a recomputed one: rebuilt by its recompute, then held).
    assert whole.peak < split.peak <= whole.peak + 4 * held
    assert split.peak_at.startswith("stage 1 W")


def test_a_selective_stage_keeps_its_backward_whole_under_a_split_schedule() -> None:
    fitted, stage_plan = _mlp_plan([4, 5], mode="selective")
    model = _StageModel(fitted, 4, 9, first=False, last=True, local=False)
    assert between_passes(model, stage_plan.modes[1]) == 0


def test_an_op_order_with_an_unknown_op_is_refused() -> None:
    fitted, stage_plan = _mlp_plan([4, 5], mode="never")
    order = [(1, "F", 0), (1, "OVERLAP_F_B", 0)]
    with pytest.raises(PipeckptConfigError, match=r"\['OVERLAP_F_B'\].*HINT"):
        predict_device(fitted, stage_plan, chunks=1, order=order)
