"""Checkpoint granularity inside a stage (`<mode>:k`): segments of k layers, each checkpointed alone.

Gradients stay bitwise equal to `never` with dropout on; a stage counts its runs as before; the
segments do not change the stage's parameters or state-dict keys."""

from typing import Any, Dict, List

import pytest
import torch
from support.toy import Counter, toy_layers
from test_boundary import run_masked, run_tree
from torch import nn

from pipeckpt import PipeckptConfigError
from pipeckpt.checkpointing.modes import ALWAYS, parse_mode
from pipeckpt.engines.local.pipeline import LocalPipeline
from pipeckpt.stages.partition import plan

CPU = [torch.device("cpu")]
GRANULAR = ["always:1", "always:2", "except_last:1", "offload:1", ["always:1", "except_last:2"]]


def layers(*, batch_norm: bool = False) -> nn.Sequential:
    """6 layers with dropout (and a BatchNorm in the first stage if asked), for 2 stages of 3."""
    torch.manual_seed(0)
    seq = list(toy_layers(depth=6, dropout=0.3))
    if batch_norm:
        seq[1] = nn.Sequential(nn.BatchNorm1d(16), seq[1])
    return nn.Sequential(*seq)


def train_once(mode: Any, *, batch_norm: bool = False) -> Dict[str, torch.Tensor]:
    """Gradients (and module state) after one pipelined forward and backward of 4 micro-batches."""
    seq = layers(batch_norm=batch_norm)
    engine = LocalPipeline(seq, plan(seq, devices=CPU, balance=[3, 3], checkpoint=mode), chunks=4)
    torch.manual_seed(1)
    engine.forward(torch.randn(8, 8, generator=torch.Generator().manual_seed(2))).pow(2).mean().backward()
    out = {f"grad:{k}": p.grad.clone() for k, p in seq.named_parameters()}
    out.update({f"state:{k}": v.clone() for k, v in seq.state_dict().items()})
    return out


def assert_bitwise(got: Dict[str, torch.Tensor], expected: Dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    for k in expected:
        assert torch.equal(got[k], expected[k]), k


def test_a_segment_length_parses_into_every_and_keeps_its_spelling():
    mode = parse_mode("always:2")
    assert (mode.name, mode.every, mode.recompute_last, mode.selective) == ("always:2", 2, True, False)
    assert parse_mode("except_last:1").every == 1 and not parse_mode("except_last:1").recompute_last
    assert ALWAYS.every is None


@pytest.mark.parametrize(
    "spec, rule",
    [
        ("always:0", r"'always:0'.*segment length '0' must be a whole number >= 1.*HINT: write <base>"),
        ("always:two", r"'always:two'.*segment length 'two'.*HINT"),
        ("never:1", r"'never:1'.*never checkpoints nothing.*HINT: write never, or"),
        ("sometimes:2", r"'sometimes:2'.*is not one of never, except_last, always, offload, selective.*HINT"),
    ],
)
def test_a_bad_segment_length_names_the_value_rule_and_fix(spec, rule):
    with pytest.raises(PipeckptConfigError, match=rule):
        parse_mode(spec)


def test_segments_cut_a_stage_into_runs_of_k_layers_and_leave_its_state_dict_alone():
    seq = layers()
    keys = list(seq.state_dict())
    engine = LocalPipeline(seq, plan(seq, devices=CPU, balance=[3, 3], checkpoint="always:2"), chunks=4)
    assert [[len(s.partition) for s in stage._segments()] for stage in engine.stages] == [[2, 1], [2, 1]]
    assert [list(s.state_dict()) for s in engine.stages] == [
        [k for k in (f"partition.{n}" for n in keys) if k.split(".")[1] in "012"],
        [f"partition.{int(k.split('.')[0]) - 3}.{k.split('.', 1)[1]}" for k in keys if k[0] in "345"],
    ]
    assert list(seq.state_dict()) == keys


@pytest.mark.parametrize("mode", GRANULAR, ids=str)
def test_granular_gradients_bitwise_equal_never_with_dropout(mode):
    assert_bitwise(train_once(mode), train_once("never"))


@pytest.mark.parametrize("mode", ["always:1", "except_last:2"])
def test_granular_gradients_and_batch_norm_statistics_equal_never(mode):
    assert_bitwise(train_once(mode, batch_norm=True), train_once("never", batch_norm=True))


@pytest.mark.parametrize("mode", ["always:1", ["always:1", "always:2", "except_last:1"]], ids=str)
def test_granular_pytree_and_side_input_gradients_bitwise_equal_never(mode):
    assert_bitwise(run_tree(mode), run_tree("never"))
    assert_bitwise(run_masked(mode), run_masked("never"))


def counted() -> nn.Sequential:
    """Each of the 6 layers headed by a Counter: it counts that layer's runs, recomputes included."""
    return nn.Sequential(*[nn.Sequential(Counter(), layer) for layer in layers()])


def layer_runs(mode: Any) -> List[int]:
    seq = counted()
    engine = LocalPipeline(seq, plan(seq, devices=CPU, balance=[3, 3], checkpoint=mode), chunks=4)
    engine.forward(torch.randn(8, 8)).pow(2).mean().backward()
    return [layer[0].calls for layer in seq] + [s.forward_calls for s in engine.stages]


@pytest.mark.parametrize(
    "mode, runs",
    [
        ("always:1", [8] * 6 + [8, 8]),  # every layer: 4 forwards + 4 recomputes; a stage counts likewise
        ("always:2", [8] * 6 + [8, 8]),
        ("except_last:1", [7] * 6 + [7, 7]),  # the last micro-batch (backward first here) is kept
    ],
)
def test_each_layer_recomputes_once_per_recomputed_microbatch(mode, runs):
    assert layer_runs(mode) == runs


def test_a_step_counts_one_recompute_per_segment_and_recomputed_microbatch():
    seq = layers()
    engine = LocalPipeline(
        seq, plan(seq, devices=CPU, balance=[3, 3], checkpoint=["always:1", "except_last:2"]), chunks=4
    )
    assert [s.recomputes_per_step(4) for s in engine.stages] == [3 * 4, 2 * 3]


def saved_activation_peak(mode: str) -> int:
    """The most 16 x 64 tensors saved for backward alive at once, over a forward and backward."""
    seq = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(3)])
    engine = LocalPipeline(seq, plan(seq, devices=CPU, balance=[3], checkpoint=mode), chunks=1)
    live, peak = [0], [0]

    class Held:
        def __init__(self, t: torch.Tensor) -> None:
            self.t = t
            live[0] += 1
            peak[0] = max(peak[0], live[0])

        def __del__(self) -> None:
            live[0] -= 1

    def pack(t: torch.Tensor) -> Any:
        return Held(t) if t.shape == (16, 64) else t

    def unpack(held: Any) -> torch.Tensor:
        return held.t if isinstance(held, Held) else held

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        engine.forward(torch.randn(16, 64, requires_grad=True)).sum().backward()
    return peak[0]


def test_segments_hold_one_segment_of_activations_at_a_time_in_backward():
    # whole stage: its input, plus the recompute of all 3 layers (linear input, tanh output each)
    assert saved_activation_peak("always") == 1 + 3 * 2
    # per layer: the 3 segment inputs, plus one layer's recompute at a time
    assert saved_activation_peak("always:1") == 3 + 2


@pytest.mark.parametrize(
    "overrides, checkpoint",
    [
        (["ckpt=per_layer"], "always:1"),
        (["ckpt=selective"], "selective"),
        (["ckpt.modes=[always:2,except_last+selective]"], ["always:2", "except_last+selective"]),
    ],
)
def test_granular_and_selective_modes_reach_the_strategy_from_hydra(tmp_path, overrides, checkpoint):
    from test_configs import build, compose_train

    assert build(compose_train(tmp_path, *overrides))["strategy"].settings.checkpoint == checkpoint
