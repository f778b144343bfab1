"""The cost model's parts, each against a hand computation from the inputs of tests/support/toy_costs.py:
a toy model of identical layers on a toy cluster whose rates make every term easy to write down."""

from dataclasses import replace

import pytest
import torch
from support.toy_costs import (
    BATCH,
    BPT,
    BW,
    FAST,
    HOST,
    LAYERS,
    PARAMS,
    RATE,
    SEQ,
    F,
    Layout,
    forward_s,
    run,
    toy,
    toy_cluster,
)
from torch import nn

from pipeckpt._errors import PipeckptConfigError
from pipeckpt.layout.cost import ADAMW_ELEMENTS_PER_PARAM, divided
from pipeckpt.layout.model_costs import (
    TensorParallelCosts,
    model_costs_from_config,
    model_costs_from_profile,
)
from pipeckpt.layout.orders import rank_orders, simulate
from pipeckpt.memory.predict import _makespan
from pipeckpt.memory.profile import fake_mode, profile


def test_one_stage_has_no_bubble_and_counts_forward_and_two_backwards() -> None:
    m = 4
    e = run(Layout(chunks=m))
    tokens = BATCH // m * SEQ
    assert e.compute_s == pytest.approx(m * 3 * forward_s(LAYERS, tokens))
    assert e.bubble_s == pytest.approx(0.0, abs=1e-15)
    assert e.step_s == pytest.approx(e.compute_s)
    assert e.tokens_per_s_per_device == pytest.approx(BATCH * SEQ / e.step_s)


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (4, 2)])
def test_gpipe_bubble_is_p_minus_1_over_m_of_the_compute(p: int, m: int) -> None:
    e = run(Layout(pp=p, chunks=m), p, cluster=toy_cluster(p, link=FAST))
    assert e.bubble_s == pytest.approx((p - 1) / m * e.compute_s)


def test_interleaving_divides_the_bubble_by_the_stages_per_rank() -> None:
    p, v, m = 2, 2, 4
    e = run(
        Layout(pp=p, schedule="interleaved_1f1b", virtual_stages=v, chunks=m),
        p,
        cluster=toy_cluster(p, link=FAST),
    )
    assert e.bubble_s == pytest.approx((p - 1) / (v * m) * e.compute_s)


def test_always_adds_one_forward_except_last_all_but_one_selective_its_share() -> None:
    m = 4
    tokens = BATCH // m * SEQ
    never = run(Layout(chunks=m, modes=("never",)))
    always = run(Layout(chunks=m, modes=("always",)))
    assert always.recompute_s == pytest.approx(m * forward_s(LAYERS, tokens))
    assert always.step_s - never.step_s == pytest.approx(always.recompute_s)
    # gpipe on one stage runs every forward, then backward from micro-batch 0: only that one is kept
    assert run(Layout(chunks=m, modes=("except_last",))).recompute_s == pytest.approx(
        (m - 1) * forward_s(LAYERS, tokens)
    )
    assert run(Layout(chunks=m, modes=("selective",))).recompute_s == pytest.approx(
        m * 0.25 * forward_s(LAYERS, tokens)
    )


def test_offload_adds_the_stage_input_over_the_host_link_both_ways() -> None:
    m = 2
    tokens = BATCH // m * SEQ
    always = run(Layout(chunks=m, modes=("always",)))
    offload = run(Layout(chunks=m, modes=("offload",)))
    assert offload.step_s - always.step_s == pytest.approx(m * 2 * tokens * BPT / HOST)


def test_doubling_tp_halves_compute_and_adds_four_all_reduces_per_layer() -> None:
    m = 2
    tokens = BATCH // m * SEQ
    one = run(Layout(chunks=m), 1)
    two = run(Layout(tp=2, chunks=m), 2)
    assert two.compute_s == pytest.approx(one.compute_s / 2)
    # Megatron: 2 all-reduces forward + 2 backward per layer; a ring of 2 moves 2(n-1)/n = 1 buffer
    all_reduce = 2 * (2 - 1) / 2 * tokens * BPT / BW
    assert two.exposed_comm_s == pytest.approx(LAYERS * m * 4 * all_reduce)
    assert two.step_s == pytest.approx(two.compute_s + two.exposed_comm_s)
    # the same group across two nodes runs at the network's rate (a tenth of the node's)
    apart = run(Layout(tp=2, chunks=m), cluster=toy_cluster(2, per_node=1))
    assert apart.exposed_comm_s == pytest.approx(10 * two.exposed_comm_s)


def test_a_split_layer_pays_its_host_work_on_every_microbatch_whatever_tp() -> None:
    # DTensor's dispatch (TensorParallelCosts.host_s) is host work per layer and micro-batch: it does
    # not shrink with tp, counts as compute (the host is busy), and an unsplit layout never pays it
    m, fwd, bwd = 2, 3e-3, 5e-3
    host = toy(tensor_parallel=TensorParallelCosts(host_s=(fwd, bwd)))
    for tp in (2, 4):
        plain, split = run(Layout(tp=tp, chunks=m), tp), run(Layout(tp=tp, chunks=m), tp, model=host)
        assert split.compute_s - plain.compute_s == pytest.approx(m * LAYERS * (fwd + bwd))
        assert split.step_s - plain.step_s == pytest.approx(m * LAYERS * (fwd + bwd))
    assert run(Layout(chunks=m), model=host).step_s == pytest.approx(run(Layout(chunks=m)).step_s)
    # a recomputed forward is split too
    always = run(Layout(tp=2, chunks=m, modes=("always",)), 2, model=host)
    assert always.recompute_s - run(Layout(tp=2, chunks=m, modes=("always",)), 2).recompute_s == (
        pytest.approx(m * LAYERS * fwd)
    )


def test_the_share_of_a_layer_tp_leaves_whole_runs_at_full_time_on_every_rank() -> None:
    # TensorParallelCosts.unsplit: a quarter of the layer is not divided, so at tp t a rank runs
    # 1/4 + 3/4 / t of the whole layer's compute; the head's own share is apart (here 0: divided)
    whole = run(Layout(chunks=1)).compute_s
    for tp in (2, 4):
        part = run(Layout(tp=tp, chunks=1), tp, model=toy(tensor_parallel=TensorParallelCosts(unsplit=0.25)))
        assert part.compute_s == pytest.approx(whole * (0.25 + 0.75 / tp))
    assert divided(0.25, 1) == 1.0 and divided(1.0, 8) == 1.0 and divided(0.0, 4) == 0.25


def test_the_heads_unsplit_share_and_host_work_fall_on_the_last_stage_alone() -> None:
    head = toy(
        head_flops=2 * F, tensor_parallel=TensorParallelCosts(head_unsplit=1.0, head_host_s=(1e-3, 2e-3))
    )
    plain = toy(head_flops=2 * F)
    split, base = run(Layout(tp=2, chunks=1), 2, model=head), run(Layout(tp=2, chunks=1), 2, model=plain)
    head_half = 2 * F * SEQ * BATCH / RATE / 2  # the head's forward at tp 2 when it divides
    assert split.compute_s - base.compute_s == pytest.approx(3 * head_half + 3e-3)  # forward and 2x backward


def test_data_parallel_all_reduce_of_float32_gradients() -> None:
    e = run(Layout(dp_replicate=2, chunks=1), 2)
    whole = LAYERS * PARAMS * 4  # bf16-mixed reduces float32 gradients
    assert e.comm_s == pytest.approx(2 * (2 - 1) / 2 * whole / BW)


def test_fsdp_gathers_bf16_parameters_and_reduce_scatters_float32_gradients() -> None:
    e = run(Layout(dp_shard=2, chunks=1), 2)
    gather = (2 - 1) / 2 * LAYERS * PARAMS * 2 / BW
    scatter = (2 - 1) / 2 * LAYERS * PARAMS * 4 / BW
    assert e.comm_s == pytest.approx(gather + scatter)
    assert 0 < e.exposed_comm_s <= e.comm_s


def test_fsdp_collectives_scale_by_the_clusters_measured_factors() -> None:
    slow = replace(toy_cluster(2), all_gather_factor=2.0, reduce_scatter_factor=3.0)  # gloo-like
    e = run(Layout(dp_shard=2, chunks=1), 2, cluster=slow)
    gather = 2.0 * (2 - 1) / 2 * LAYERS * PARAMS * 2 / BW
    scatter = 3.0 * (2 - 1) / 2 * LAYERS * PARAMS * 4 / BW
    assert e.comm_s == pytest.approx(gather + scatter)


def test_without_overlap_every_collective_lengthens_the_step_whole() -> None:
    kept = run(Layout(dp_shard=2, chunks=2), 2)
    serial = run(Layout(dp_shard=2, chunks=2), 2, cluster=replace(toy_cluster(2), overlaps=False))
    assert 0 < kept.exposed_comm_s < kept.comm_s
    assert serial.exposed_comm_s == pytest.approx(serial.comm_s)
    assert serial.step_s == pytest.approx(kept.step_s - kept.exposed_comm_s + kept.comm_s)


def test_processes_outnumbering_the_cores_share_them_while_busy() -> None:
    """4 pipeline stages on 2 cores: longer than the critical path on a core each and than every
    process's work over the cores, since in 1F1B's steady state four ranks busy at once each run at
    half speed along the chain of stages (pipeckpt.layout.shared_cores, whose rule
    tests/layout/test_shared_cores.py checks by hand)."""
    whole = run(Layout(pp=4, schedule="1f1b", chunks=8), 4)  # one core each
    shared = run(Layout(pp=4, schedule="1f1b", chunks=8), 4, cluster=replace(toy_cluster(4), cores=2))
    work = 4 * whole.compute_s  # every stage's forward and backward, the same on each
    assert whole.step_s < work / 2 < shared.step_s
    assert shared.shared_s == pytest.approx(shared.step_s - whole.step_s)
    few = run(Layout(pp=4, chunks=1), 4, cluster=replace(toy_cluster(4), cores=2))
    assert few.shared_s == 0.0  # one micro-batch: one stage at a time, each on a core of its own


def test_optimizer_step_is_memory_bound() -> None:
    e = run(Layout(dp_shard=2), 2, cluster=toy_cluster(2, link=FAST, memory=1e9))
    held = LAYERS * PARAMS / 2  # the rank's shard, float32 master, AdamW's elements
    assert e.optimizer_s == pytest.approx(held * ADAMW_ELEMENTS_PER_PARAM * 4 / 1e9)


def test_engine_cost_per_microbatch_and_stage() -> None:
    m = 4
    e = run(Layout(chunks=m), engine=1e-3)
    assert e.engine_s == pytest.approx(m * 1e-3)
    assert e.step_s == pytest.approx(e.compute_s + e.engine_s)


def test_simulation_agrees_with_the_memory_models_makespan() -> None:
    """Unequal stages, GPipe and 1F1B: the layout simulation and memory/predict.py's makespan."""
    p, m = 3, 5
    cost = {0: (1.0, 2.5), 1: (2.0, 3.0), 2: (0.5, 1.5)}
    for schedule in ("gpipe", "1f1b"):
        orders = rank_orders(schedule, p, 1, m)
        ends = simulate(orders, lambda op: cost[op[0]][0 if op[1] == "F" else 1], stages=p)
        staged = [[(k, i) for _, k, i in ops] for ops in orders]
        times = [{(k, i): cost[j][0 if k == "F" else 1] for k, i in staged[j]} for j in range(p)]
        assert max(ends) == pytest.approx(_makespan(staged, times, local=False))


def test_gpt_config_gives_megatrons_equation_3() -> None:
    """Narayanan et al. SC'21 Eq. 3: a step with full recompute is 96 B s l h^2 (1 + s/6h + V/16lh)."""
    h, heads, layers, s, v = 256, 4, 3, 128, 1000
    m = model_costs_from_config(dict(n_embd=h, n_head=heads, n_layer=layers, vocab_size=v), seq_len=s)
    with_recompute = m.model_flops_per_token(s) + sum(m.flops_at(s))
    assert with_recompute == pytest.approx(96 * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h)))
    # attention rescales with the sequence
    assert m.flops_at(2 * s)[0] - m.flops_at(s)[0] == pytest.approx(4 * s * h)


def test_config_parameters_equal_transformers_own_count() -> None:
    transformers = pytest.importorskip("transformers")
    llama = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=176, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=300,
    )  # fmt: skip
    gpt2 = transformers.GPT2Config(n_embd=64, n_layer=3, n_head=4, vocab_size=300, n_positions=32)
    neox = transformers.GPTNeoXConfig(
        hidden_size=64, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
        vocab_size=300, max_position_embeddings=32, tie_word_embeddings=False,
    )  # fmt: skip
    for config, cls, tied in (
        (llama, transformers.LlamaForCausalLM, False),
        (gpt2, transformers.GPT2LMHeadModel, True),
        (neox, transformers.GPTNeoXForCausalLM, False),  # rotary: no position embedding
    ):
        with torch.device("meta"):
            model = cls(config)
        counted = model_costs_from_config(config, seq_len=8).params
        # a tied head is counted again on the last stage, which holds it too
        assert counted - (config.vocab_size * 64 if tied else 0) == model.num_parameters()


def test_profile_costs_are_the_flop_counts_per_token() -> None:
    b, rate = 4, 1e12
    with fake_mode():
        seq = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
        x = torch.randn(b, 8)
    p = profile(seq, x, fake=True, flops_per_s=rate)
    m = model_costs_from_profile(p, flops_per_s=rate)
    assert m.layer_flops[0] == pytest.approx(2 * 8 * 16)  # per sample (a token here)
    assert m.layer_flops[2] == pytest.approx(2 * 16 * 2)
    assert m.layer_params == (8 * 16 + 16, 0, 16 * 2 + 2)
    assert m.boundary_bytes_per_token == pytest.approx(2 * 4)  # the last output, float32, per sample


@pytest.mark.parametrize(
    "schedule, v, m",
    [
        ("interleaved_1f1b", 2, 4),
        ("interleaved_1f1b", 3, 6),
        ("looped_bfs", 2, 4),
        ("interleaved_zero_bubble", 2, 4),
        ("zbv_zero_bubble", 2, 4),
        ("dual_pipe_v", 2, 4),
    ],
)
def test_looped_orders_are_the_live_schedules(schedule: str, v: int, m: int) -> None:
    """A looped schedule built around live stages on a fake 2-rank world orders rank 0's ops as
    rank_orders says (DualPipeV's overlapped forward-backward pairs, which the live order lists as
    one action without a micro-batch, expanded into their two ops)."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from pipeckpt._compat import live_op_order
    from pipeckpt.engines.distributed.schedules import lookup

    pp, kind = 2, lookup(schedule)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=pp)
    try:
        stages = [
            PipelineStage(nn.Linear(2, 2), j, pp * v, torch.device("cpu"))
            for j in kind.stages_of(0, pp, pp * v)
        ]
        live = live_op_order(kind.cls(stages, n_microbatches=m, loss_fn=lambda out, target: out.sum()))
    finally:
        dist.destroy_process_group()
    mine = list(rank_orders(schedule, pp, v, m)[0])
    if schedule != "dual_pipe_v":
        assert mine == live
    else:
        rest = iter(mine)
        assert all(op in rest for op in live)  # the live ops, in order, among ours
    for j in kind.stages_of(0, pp, pp * v):  # every micro-batch forward and backward once per stage
        assert sorted(i for s, k, i in mine if s == j and k == "F") == list(range(m))
        assert sorted(i for s, k, i in mine if s == j and k in ("B", "I")) == list(range(m))


def test_sends_cross_the_link_the_mesh_puts_between_the_stages() -> None:
    """Two stages, one micro-batch: the forward's send and the backward's send are on the critical path,
    over NVLink-like links on one node and a tenth of that across two."""
    tokens = BATCH * SEQ
    together = run(Layout(pp=2), 2)
    apart = run(Layout(pp=2), cluster=toy_cluster(2, per_node=1))
    quiet = run(Layout(pp=2), cluster=toy_cluster(2, link=FAST))
    assert together.step_s - quiet.step_s == pytest.approx(2 * tokens * BPT / BW)
    assert apart.step_s - quiet.step_s == pytest.approx(2 * tokens * BPT / (BW / 10))


def test_except_last_keeps_what_the_order_lets_it_keep_under_1f1b() -> None:
    """1F1B on 2 stages, 4 micro-batches: the first stage keeps only micro-batch 0 (its first backward),
    the last stage every one (each backward follows its own forward); the first stage ends last."""
    m = 4
    tokens = BATCH // m * SEQ
    e = run(
        Layout(pp=2, schedule="1f1b", chunks=m, modes=("except_last",) * 2), cluster=toy_cluster(2, link=FAST)
    )
    assert e.recompute_s == pytest.approx((m - 1) * forward_s(LAYERS // 2, tokens))


def test_profile_costs_default_to_the_fake_profiles_own_rate() -> None:
    """A fake profile's times are FLOPs at profile()'s default rate; a measured one needs the rate of
    the device that measured it."""
    with fake_mode():
        seq = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 2))
        x = torch.randn(4, 8)
    m = model_costs_from_profile(profile(seq, x, fake=True))
    assert m.layer_flops == pytest.approx((2 * 8 * 16, 2 * 16 * 2))
    measured = profile(nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 2)), torch.randn(4, 8), rounds=1)
    with pytest.raises(PipeckptConfigError, match="flops_per_s"):
        model_costs_from_profile(measured)


@pytest.mark.parametrize(
    "schedule, v",
    [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("looped_bfs", 2), ("zbv_zero_bubble", 2)],
)
@pytest.mark.parametrize("mode", ["never", "except_last", "always", "offload"])
def test_parts_add_up_to_the_step(schedule: str, v: int, mode: str) -> None:
    """pp 2 x tp 2 on 4 devices in 2 nodes (TP within a node, the pipeline across them): the step is
    its parts, and what is exposed of the communication is part of it."""
    layout = Layout(
        pp=2, tp=2, dp_shard=1, schedule=schedule, virtual_stages=v, chunks=4, modes=(mode,) * (2 * v)
    )
    for reshard in (False, True):
        e = run(layout, cluster=toy_cluster(4, per_node=2), engine=1e-4, reshard_after_forward=reshard)
        parts = e.compute_s + e.recompute_s + e.bubble_s + e.exposed_comm_s + e.engine_s + e.optimizer_s
        assert parts == pytest.approx(e.step_s)
        assert 0 < e.exposed_comm_s <= e.comm_s and e.bubble_s >= 0


def test_reducing_every_microbatch_adds_a_reduce_scatter_for_each_micro_batch_but_the_last() -> None:
    once = run(Layout(dp_shard=2, chunks=4), 2)
    every = run(Layout(dp_shard=2, chunks=4), 2, reduce_every_microbatch=True)
    scatter = (2 - 1) / 2 * LAYERS * PARAMS * 4 / BW  # float32 gradients, as the step's own
    assert every.comm_s == pytest.approx(once.comm_s + 3 * scatter)
    # under the backward but its last unit's share, which the step waits for
    assert every.step_s >= once.step_s + 3 * scatter / LAYERS


def test_reducing_every_microbatch_changes_nothing_at_one_micro_batch() -> None:
    once = run(Layout(dp_shard=2, chunks=1), 2)
    every = run(Layout(dp_shard=2, chunks=1), 2, reduce_every_microbatch=True)
    assert (every.step_s, every.comm_s) == (once.step_s, once.comm_s)
