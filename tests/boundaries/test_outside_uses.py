"""Which stages of a ``pipeline_of`` model read each parameter outside its layers, probed from the
model's own ``forward`` on fake tensors (pipeckpt/boundaries/outside_uses.py), and what a rank then
holds and answers for (pipeckpt/engines/distributed/outside_parts.py). Unmodified Hugging Face
models built from configs (random weights): Llama, GPT-2 (head tied to the embedding), T5 (encoder
final norm read by every decoder layer), BART (four names of one shared embedding), Qwen3-MoE."""

from typing import Any, Dict, Tuple

import pytest
import torch
import transformers as hf
from support.real_models import client
from torch import nn

from pipeckpt import pipeline_of
from pipeckpt.boundaries.outside_uses import outside_uses
from pipeckpt.engines.distributed.outside_parts import drop, outside_parts
from pipeckpt.engines.distributed.replay import capture_call

CPU = torch.device("cpu")
IDS = torch.randint(3, 100, (2, 8), generator=torch.Generator().manual_seed(0))


def _llama(**kw: Any) -> nn.Module:
    config = hf.LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=2, **kw,
    )  # fmt: skip
    return hf.LlamaForCausalLM(config)


def _stages(
    model: nn.Module, layers: Tuple[str, ...], ranges: Any, fake: bool = True, **call: Any
) -> Dict[str, Tuple[int, ...]]:
    spec = pipeline_of(model, *layers)
    uses = outside_uses(spec, (), call, CPU, fake=fake)
    inside = {id(p) for p in spec.parameters()}
    return uses.stages(ranges, [n for n, p in model.named_parameters() if id(p) not in inside])


def test_llamas_embedding_is_read_by_the_first_stage_alone_and_its_norm_and_head_by_the_last() -> None:
    stages = _stages(_llama(), ("model.layers",), [(0, 2), (2, 4)], input_ids=IDS, labels=IDS)
    assert stages == {"model.embed_tokens.weight": (0,), "model.norm.weight": (1,), "lm_head.weight": (1,)}


def test_a_middle_stage_reads_nothing_outside_its_layers() -> None:
    stages = _stages(_llama(), ("model.layers",), [(0, 1), (1, 2), (2, 3), (3, 4)], input_ids=IDS)
    assert stages == {"model.embed_tokens.weight": (0,), "model.norm.weight": (3,), "lm_head.weight": (3,)}


def test_a_head_tied_to_the_embedding_is_read_by_the_first_and_the_last_stage() -> None:
    config = hf.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, bos_token_id=0, eos_token_id=0)
    stages = _stages(hf.GPT2LMHeadModel(config), ("transformer.h",), [(0, 1), (1, 2)], input_ids=IDS)
    assert stages == {
        "transformer.wte.weight": (0, 1),
        "transformer.wpe.weight": (0,),
        "transformer.ln_f.weight": (1,),
        "transformer.ln_f.bias": (1,),
    }


def test_t5s_encoder_norm_is_read_by_the_decoder_stages_and_not_by_the_encoders_last() -> None:
    config = hf.T5Config(
        num_layers=2, num_decoder_layers=2, d_model=32, d_ff=64, num_heads=2, d_kv=16, vocab_size=100,
        decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    model = hf.T5ForConditionalGeneration(config)
    stages = _stages(
        model, ("encoder.block", "decoder.block"), [(0, 1), (1, 2), (2, 3), (3, 4)], input_ids=IDS, labels=IDS
    )
    assert stages["encoder.final_layer_norm.weight"] == (2, 3)  # the decoder layers cross-attend to it
    assert stages["shared.weight"] == (0, 2, 3)  # encoder and decoder embeddings, and the tied head
    assert stages["decoder.final_layer_norm.weight"] == (3,)


def test_barts_shared_embedding_is_read_where_each_of_its_names_is() -> None:
    config = hf.BartConfig(
        encoder_layers=2, decoder_layers=2, d_model=32, encoder_ffn_dim=64, decoder_ffn_dim=64,
        encoder_attention_heads=2, decoder_attention_heads=2, vocab_size=100, max_position_embeddings=64,
    )  # fmt: skip
    model = hf.BartForConditionalGeneration(config)
    stages = _stages(
        model, ("model.encoder.layers", "model.decoder.layers"), [(0, 2), (2, 4)], input_ids=IDS, labels=IDS
    )
    assert stages["model.shared.weight"] == (0, 1)
    assert stages["model.encoder.embed_positions.weight"] == (0,)
    assert stages["model.decoder.embed_positions.weight"] == (1,)


def test_an_moe_models_router_outputs_do_not_make_the_last_stage_read_the_embedding() -> None:
    config = hf.Qwen3MoeConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
        output_router_logits=True, decoder_sparse_step=1,
    )  # fmt: skip
    # On its real tensors: its grouped experts' kernel refuses float32 fake tensors (the engine's probe
    # falls back so, outside_parts._probe).
    model = hf.Qwen3MoeForCausalLM(config)
    stages = _stages(model, ("model.layers",), [(0, 1), (1, 2)], fake=False, input_ids=IDS, labels=IDS)
    assert stages["model.embed_tokens.weight"] == (0,)
    assert stages["lm_head.weight"] == (1,)


def test_a_frozen_embedding_is_found_as_a_trained_one_is() -> None:
    model = _llama()
    model.model.embed_tokens.weight.requires_grad_(False)
    stages = _stages(model, ("model.layers",), [(0, 2), (2, 4)], input_ids=IDS)
    assert stages["model.embed_tokens.weight"] == (0,)
    assert not model.model.embed_tokens.weight.requires_grad  # left as it was


class _ReadsTheWeight(nn.Module):
    """Its forward indexes the embedding's weight itself, outside the embedding's call."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.head = nn.Linear(4, 10)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed.weight[ids]
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_a_weight_read_outside_its_modules_call_is_held_by_every_stage() -> None:
    stages = _stages(_ReadsTheWeight(), ("layers",), [(0, 1), (1, 2)], ids=torch.tensor([[1, 2]]))
    assert stages == {"embed.weight": (0, 1), "head.weight": (1,), "head.bias": (1,)}


def test_a_model_caching_a_value_on_its_call_is_left_as_it_was() -> None:
    module, loader = client("demo")  # Lightning's demo Transformer keeps its mask and positions
    spec = module.configure_pipeline()
    call = capture_call(module, spec.root, "training_step", next(iter(loader)), (0,), {})
    before = {n: dict(m.__dict__) for n, m in spec.root.named_modules()}
    outside_uses(spec, *call, CPU, fake=False)
    with pytest.raises(RuntimeError):  # it compares its mask with a causal one: a value fake tensors lack
        outside_uses(spec, *call, CPU)
    after = {n: dict(m.__dict__) for n, m in spec.root.named_modules()}
    assert before.keys() == after.keys()
    for name in before:
        assert before[name].keys() == after[name].keys(), name
        assert all(after[name][k] is v for k, v in before[name].items()), name


def test_a_rank_holds_only_what_its_stages_read_and_zeros_answer_for_the_rest() -> None:
    model = _llama()
    spec = pipeline_of(model, "model.layers")
    uses = outside_uses(spec, (), dict(input_ids=IDS), CPU)
    parts = outside_parts(spec, uses, [(0, 2), (2, 4)], mine=[1], ranks=[[0], [1]])
    assert parts.held == ["model.norm.weight", "lm_head.weight"]
    assert parts.standing_in == [model.model.embed_tokens]
    drop(model, parts, CPU)
    assert model.model.embed_tokens.weight.is_meta
    out = model.model.embed_tokens(IDS)
    assert out.device == CPU and out.shape == (2, 8, 32) and out.dtype == torch.float32
    assert not out.any()


def test_reading_the_first_batch_for_the_probe_leaves_a_shuffled_loaders_order_as_it_was() -> None:
    # The probe reads the fit's first batch on rank 0 only: every rank must then read the same order.
    from torch.utils.data import DataLoader

    from pipeckpt.engines.distributed import outside_parts

    data = list(range(32))
    loader = DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3))
    untouched = DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3))
    with outside_parts._generators_kept(loader):
        next(iter(loader))
    assert [b.tolist() for b in loader] == [b.tolist() for b in untouched]
