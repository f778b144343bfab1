"""The example models: shapes, GPT's initial loss and causality, size presets."""

import math

import pytest
import torch
from torch import nn

from pipeckpt.app.models import GPT, MLP, SIZES, ConvNet, gpt_layers
from pipeckpt.app.models.gpt import warmup_cosine


def tiny_gpt(**kwargs) -> GPT:
    torch.manual_seed(0)
    return GPT(size="tiny", seq_len=32, dropout=0.0, **kwargs).eval()


def test_gpt_layers_are_embedding_blocks_norm_and_head():
    layers = gpt_layers(vocab_size=256, seq_len=16, dropout=0.0, **SIZES["tiny"])
    assert len(layers) == SIZES["tiny"]["n_layers"] + 3
    assert isinstance(layers[-2], nn.LayerNorm)
    assert isinstance(layers[-1], nn.Linear) and layers[-1].bias is None


def test_gpt_layers_each_map_one_tensor_to_one_tensor():
    layers = gpt_layers(vocab_size=256, seq_len=16, dropout=0.0, **SIZES["tiny"])
    x = torch.randint(256, (2, 16))
    for layer in layers:
        x = layer(x)
        assert isinstance(x, torch.Tensor)
    assert x.shape == (2, 16, 256)


def test_gpt_small_is_gpt2_small_with_a_byte_vocabulary():
    layers = gpt_layers(vocab_size=256, seq_len=1024, dropout=0.0, **SIZES["small"])
    assert SIZES["small"] == {"d_model": 768, "n_heads": 12, "n_layers": 12}
    # GPT-2 small's 124,439,808 parameters, less the 50257-token embedding, plus an untied 256-way head.
    assert sum(p.numel() for p in layers.parameters()) == 86_235_648


def test_gpt_loss_at_init_is_close_to_uniform_over_256_bytes():
    model = tiny_gpt()
    x = torch.randint(256, (8, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        loss = model._loss((x, x))
    assert abs(loss.item() - math.log(256)) < 0.1


def test_gpt_is_causal_changing_token_t_changes_no_logit_before_t():
    model = tiny_gpt()
    x = torch.randint(256, (1, 32), generator=torch.Generator().manual_seed(1))
    changed = x.clone()
    changed[0, 20] = (x[0, 20] + 1) % 256
    with torch.no_grad():
        a, b = model(x), model(changed)
    assert torch.equal(a[:, :20], b[:, :20])
    assert not torch.allclose(a[:, 20:], b[:, 20:])


def test_gpt_rejects_a_sequence_longer_than_its_position_table():
    with pytest.raises(ValueError, match="seq_len"):
        tiny_gpt()(torch.zeros(1, 33, dtype=torch.long))


def test_gpt_overrides_replace_the_size_and_none_keeps_it():
    model = GPT(size="tiny", n_layers=2, d_model=None)
    assert len(model.layers) == 2 + 3
    assert model.layers[0].token.embedding_dim == SIZES["tiny"]["d_model"]


def test_gpt_hyper_parameters_hold_the_sizes_it_built_not_none():
    assert {k: GPT(size="tiny").hparams[k] for k in SIZES["tiny"]} == SIZES["tiny"]
    assert GPT(size="tiny", n_layers=2, n_heads=None).hparams["n_layers"] == 2


def test_gpt_unknown_override_names_the_allowed_ones():
    with pytest.raises(TypeError, match="n_layers"):
        GPT(size="tiny", n_layer=2)


def test_gpt_unknown_size_lists_the_sizes():
    with pytest.raises(ValueError, match="mini"):
        GPT(size="huge")


def test_configure_pipeline_returns_the_modules_own_sequential():
    for model in (tiny_gpt(), MLP(), ConvNet()):
        assert model.configure_pipeline() is model.layers


def test_mlp_has_a_layer_per_linear_and_relu():
    model = MLP(in_features=8, hidden=16, depth=3, num_classes=5)
    assert len(model.layers) == 2 * 3 + 1
    assert model(torch.randn(4, 8)).shape == (4, 5)


def test_convnet_classifies_any_image_size_with_batch_norm_layers():
    model = ConvNet(in_channels=1, width=4, num_classes=3)
    assert sum(isinstance(m, nn.BatchNorm2d) for m in model.layers) == 3
    assert model(torch.randn(2, 1, 20, 12)).shape == (2, 3)


def test_warmup_cosine_rises_linearly_then_decays_to_the_floor():
    factor = warmup_cosine(warmup_steps=10, total_steps=110, min_ratio=0.1)
    assert factor(0) == pytest.approx(0.1)
    assert factor(9) == pytest.approx(1.0)
    assert factor(60) == pytest.approx(0.55)
    assert factor(110) == pytest.approx(0.1)
    assert factor(500) == pytest.approx(0.1)
