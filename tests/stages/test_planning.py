"""Stage plans: balance, placement and the errors for impossible layouts."""

import pytest
import torch
from torch import nn

from pipeckpt import PipeckptConfigError
from pipeckpt.stages.partition import min_max_partition, plan, split

CPU2 = [torch.device("cpu")] * 2
GPU2 = [torch.device("cuda", 0), torch.device("cuda", 1)]


def linears(n: int, width: int = 8) -> nn.Sequential:
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(n)])


def test_split_shares_the_users_layer_objects():
    seq = linears(4)
    parts = split(seq, [1, 3])
    assert parts[0][0] is seq[0] and parts[1][2] is seq[3]


def test_default_is_one_stage_per_device():
    assert plan(linears(4), devices=CPU2).balance == (2, 2)


def test_balance_by_params_follows_parameter_counts():
    seq = nn.Sequential(
        nn.Linear(256, 256), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
    )
    assert plan(seq, devices=CPU2, stages=2).balance == (1, 4)


def test_balance_by_time_works_when_parameters_hold_gradients():
    seq = linears(4)
    seq(torch.randn(2, 8)).sum().backward()
    grads = [p.grad.clone() for p in seq.parameters()]
    balance = plan(seq, devices=CPU2, stages=2, balance_by="time", sample=torch.randn(4, 8)).balance
    assert sum(balance) == 4 and len(balance) == 2
    assert all(torch.equal(p.grad, g) for p, g in zip(seq.parameters(), grads))


def test_balance_by_time_without_example_input_says_how_to_give_one():
    with pytest.raises(PipeckptConfigError, match="example_input_array"):
        plan(linears(4), devices=CPU2, stages=2, balance_by="time")


def test_balance_by_memory_on_cpu_is_refused():
    with pytest.raises(PipeckptConfigError, match="CUDA devices only"):
        plan(linears(4), devices=CPU2, stages=2, balance_by="memory", sample=torch.randn(4, 8))


def test_balance_must_sum_to_the_layer_count():
    with pytest.raises(
        PipeckptConfigError, match=r"balance \[2, 1\] \(sum 3\).*number of layers.*\(4\).*HINT"
    ):
        plan(linears(4), devices=CPU2, balance=[2, 1])


def test_more_stages_than_layers_is_refused():
    with pytest.raises(PipeckptConfigError, match=r"stages=5.*number of layers \(4\)"):
        plan(linears(4), devices=CPU2, stages=5)


def test_more_stages_than_distinct_devices_needs_a_placement():
    with pytest.raises(PipeckptConfigError, match=r"3 stages on 2 devices.*HINT.*placement"):
        plan(linears(4), devices=GPU2, stages=3)


def test_placement_puts_several_stages_on_one_device():
    p = plan(linears(4), devices=GPU2, stages=3, placement=[0, 0, 1])
    assert p.devices == (GPU2[0], GPU2[0], GPU2[1])


def test_placement_index_out_of_range_is_refused():
    with pytest.raises(PipeckptConfigError, match=r"placement \[0, 2\]"):
        plan(linears(4), devices=GPU2, stages=2, placement=[0, 2])


def test_stages_on_one_cpu_share_it():
    assert plan(linears(4), devices=[torch.device("cpu")], stages=4).devices == (torch.device("cpu"),) * 4


def test_a_parameter_shared_by_stages_on_two_devices_is_refused_by_its_own_name():
    shared = nn.Linear(8, 8)
    seq = nn.Sequential(shared, nn.ReLU(), shared)
    two = [torch.device("cpu", 0), torch.device("cpu", 1)]
    with pytest.raises(
        PipeckptConfigError,
        match=r"parameter 'layers.0.weight' \(also layers.2.weight\), shared by stage 0 on cpu:0 and stage 1 "
        r"on cpu:1.*HINT: place the stages",
    ):
        plan(seq, devices=two, balance=[2, 1], names=["layers.0", "layers.1", "layers.2"])


def test_a_parameter_shared_by_stages_on_one_device_is_allowed():
    shared = nn.Linear(8, 8)
    assert plan(nn.Sequential(shared, nn.ReLU(), shared), devices=CPU2, balance=[2, 1]).stages == 2


def test_a_parameter_shared_inside_one_stage_is_allowed():
    shared = nn.Linear(8, 8)
    assert plan(nn.Sequential(shared, shared, nn.ReLU()), devices=CPU2, balance=[2, 1]).stages == 2


def test_ranges_give_each_stages_layer_indices():
    assert plan(linears(5), devices=CPU2, balance=[2, 3]).ranges == [(0, 2), (2, 5)]


@pytest.mark.parametrize(
    "costs, stages, expected",
    [
        ([100, 1, 1, 1, 1], 2, (1, 4)),
        ([1, 1, 1, 1, 100], 2, (4, 1)),
        ([3, 3, 3, 3], 4, (1, 1, 1, 1)),
        ([5, 1, 1, 5, 1, 1], 2, (3, 3)),
    ],
)
def test_min_max_partition_minimises_the_heaviest_stage(costs, stages, expected):
    assert min_max_partition(costs, stages) == expected
