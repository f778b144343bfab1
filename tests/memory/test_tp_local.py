"""A layer a tensor-parallel plan splits, profiled as one rank runs it (memory/tp_local.py): the
tensors between a colwise and a rowwise Linear are 1/tp of the whole, the layer's input and output
whole, and the parameters' figures the whole layer's (the rank states divide those by the plan)."""

import pytest
import torch
from torch import nn
from transformers import GPTNeoXConfig, LlamaConfig
from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXLayer, GPTNeoXRotaryEmbedding
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from pipeckpt.memory.profile import profile
from pipeckpt.memory.tp_local import cut_to_one_rank, one_rank_profile

WIDTH, HIDDEN, TOKENS = 8, 32, 64
PLAN = {"up": "colwise", "down": "rowwise"}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.down = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


def _layers() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block())


def _profiled(layers: nn.Sequential):
    return profile(layers, torch.randn(TOKENS, WIDTH), loss_fn=lambda y, t: y.sum(), fake=True)


@pytest.mark.parametrize("tp", [2, 4])
def test_the_hidden_features_a_rank_saves_are_a_tp_share(tp: int) -> None:
    whole = _profiled(_layers())
    layers = _layers()
    cut = one_rank_profile(layers, PLAN, tp, lambda: _profiled(layers))
    f32 = 4
    for w, c in zip(whole.layers[:2], cut.layers[:2]):
        # saved beyond the layer's input: relu's output (which down reads too), the hidden features
        assert whole.bytes_of(set(w.saved) - set(w.inputs)) == f32 * TOKENS * HIDDEN
        assert cut.bytes_of(set(c.saved) - set(c.inputs)) == f32 * TOKENS * HIDDEN // tp
        assert (c.param_bytes, c.param_tensors, c.largest_param) == (
            w.param_bytes,
            w.param_tensors,
            w.largest_param,
        )


def test_cut_narrows_the_split_dimension_only() -> None:
    layers = _layers()
    assert len(cut_to_one_rank(layers, PLAN, 2)) == 6  # up's weight and bias, down's weight, per block
    block = layers[0]
    assert block.up.weight.shape == (HIDDEN // 2, WIDTH) and block.up.bias.shape == (HIDDEN // 2,)
    assert block.down.weight.shape == (WIDTH, HIDDEN // 2) and block.down.bias.shape == (WIDTH,)
    assert len(cut_to_one_rank(layers, PLAN, 1)) == 0


def test_an_hf_llama_layer_runs_cut_with_its_heads_shared_out() -> None:
    """transformers' attention reshapes by -1 over its heads: cut by the model's own plan, a layer
    runs with heads / tp of them, its output whole."""
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=1,
    )
    layer = LlamaDecoderLayer(config, 0)
    plan = {k.split("layers.*.", 1)[1]: v for k, v in config.base_model_tp_plan.items() if "layers.*." in k}
    assert len(cut_to_one_rank(nn.Sequential(layer), plan, 2)) == 7  # q, k, v, o, gate, up, down
    x = torch.randn(1, 5, 64)
    rope = LlamaRotaryEmbedding(config)(x, torch.arange(5)[None])
    out = layer(x, position_embeddings=rope)
    out = out[0] if isinstance(out, tuple) else out
    assert out.shape == x.shape
    assert layer.self_attn.q_proj.weight.shape == (32, 64) and layer.mlp.down_proj.weight.shape == (64, 48)


def test_an_hf_gpt_neox_layer_runs_cut_with_its_fused_heads_shared_out() -> None:
    """GPT-NeoX's one query-key-value Linear has its columns grouped by head (each head's q, k and
    v together), and its attention reshapes them by -1 heads: cut colwise, a rank runs heads / tp."""
    config = GPTNeoXConfig(hidden_size=64, intermediate_size=256, num_attention_heads=4, num_hidden_layers=1)
    layer = GPTNeoXLayer(config, 0)
    plan = {k.split("layers.*.", 1)[1]: v for k, v in config.base_model_tp_plan.items() if "layers.*." in k}
    assert len(cut_to_one_rank(nn.Sequential(layer), plan, 2)) == 6  # 4 weights, the colwise ones' biases
    x = torch.randn(1, 5, 64)
    rope = GPTNeoXRotaryEmbedding(config)(x, torch.arange(5)[None])
    out = layer(x, position_embeddings=rope)
    out = out[0] if isinstance(out, tuple) else out
    assert out.shape == x.shape
    assert layer.attention.query_key_value.weight.shape == (96, 64)  # 2 of 4 heads' q, k and v
    assert layer.mlp.dense_4h_to_h.weight.shape == (64, 128)


def test_the_layers_are_left_as_they_were_after_the_profile() -> None:
    """``checkpoint='auto'`` profiles the user's own model so: its parameters are the same objects
    with the same values (its hooks: the test below runs the model after)."""
    layers = _layers()
    before = {n: (p, p.detach().clone()) for n, p in layers.named_parameters()}
    one_rank_profile(layers, PLAN, 2, lambda: _profiled(layers), sequence=False)
    after = dict(layers.named_parameters())
    assert after.keys() == before.keys()
    for n, (p, value) in before.items():
        assert after[n] is p and torch.equal(p, value)


@pytest.mark.parametrize("sequence", [False, True], ids=["tp", "tp_sp"])
def test_auto_under_tp2_counts_one_ranks_activations_as_the_search_does(sequence: bool) -> None:
    """The engine's ``checkpoint='auto'`` (memory/budget.py) profiles a tensor-parallel layout's layers
    cut to one rank, as the layout search and the plan command do: the activations between the
    colwise and rowwise projections half of the whole (with sequence parallelism the rest too);
    profiled whole, auto counted them twice over at tp 2, and recomputed where a rank had room."""
    from transformers import LlamaForCausalLM

    from pipeckpt import pipeline_of
    from pipeckpt.engines.distributed.tensor_parallel import layer_plan
    from pipeckpt.memory.budget import first_microbatch, resolve_auto
    from pipeckpt.memory.rooted import RootInput
    from pipeckpt.memory.sharding import Layout
    from pipeckpt.settings import PipeSettings

    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    batch = RootInput((), dict(input_ids=ids))
    settings = PipeSettings(
        engine="distributed", checkpoint="auto", memory_budget="1GiB", stages=1, chunks=2,
        schedule="gpipe", tensor_parallel=2, data_parallel="fsdp", sequence_parallel=sequence,
    )  # fmt: skip

    def model():  # type: ignore[no-untyped-def]
        torch.manual_seed(0)
        return pipeline_of(LlamaForCausalLM(config), "model.layers")

    spec = model()
    before = spec.root(ids).logits.detach()
    plan = layer_plan(spec, settings).tensor_parallel_plan
    layout = Layout(tp=2, tp_plan=tuple(plan.items()), sequence_parallel=sequence)
    chosen = resolve_auto(settings, spec, devices=[torch.device("cpu")], batch=batch, layout=layout)
    mine = chosen.profiles[2]
    searched = model()  # the search's way: a throwaway build cut to one rank
    micro = first_microbatch(batch, 2)
    cut = one_rank_profile(searched, plan, 2, lambda: profile(searched, micro, rounds=2), sequence=sequence)
    whole_profile = profile(model(), micro, rounds=2)
    assert torch.equal(spec.root(ids).logits, before)  # the user's model as it was: no cut, no hook
    for m, c, w in zip(mine.layers, cut.layers, whole_profile.layers):
        assert (
            mine.bytes_of(set(m.saved)) == cut.bytes_of(set(c.saved)) < whole_profile.bytes_of(set(w.saved))
        )
