"""The memory model's rules for the distributed engine (torch's GPipe and 1F1B), apart from measurement.

Measured against the model in tests/test_bench_distributed_memory_smoke.py (two gloo processes) and
benchmarks/bench_distributed_memory.py; here each rule the model adds for torch's schedules is
pinned on its own: which sends still hold a tensor during each op, and how a stage's output, which
torch's PipelineStage holds until the micro-batch's backward, adds to what the micro-batch keeps.
"""

import torch
import torch.nn.functional as F

from pipeckpt.memory import _StageModel, op_order, profile, sends_held
from pipeckpt.models.mlp import mlp_layers
from pipeckpt.modes import parse_modes


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


def test_a_kept_micro_batchs_backward_counts_the_held_output_once() -> None:
    stage = _first_stage()
    never = parse_modes("never", 1)[0]
    plain = stage.backward_events(never, False)
    held = stage.backward_events(never, False, output=True)
    assert [e[2] for e in plain] == [e[2] for e in held]  # the Function holds that output already
