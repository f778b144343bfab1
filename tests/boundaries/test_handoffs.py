"""Which layer outputs cross each stage boundary of a ``pipeline_of`` model under the distributed
engine (pipeckpt/boundaries/outside_uses.py ``Handoffs``; sent by engines/distributed/handoffs.py):
those a later stage reads, found from the model's own ``forward``, not every output so far.
Unmodified Hugging Face models built from configs (random weights). A leaf is ``(layer, n)``: the
``n``-th tensor of that layer's output (router logits ride beside an MoE layer's output)."""

from typing import Any, Tuple

import torch
from support.hf_zoo import BUILDERS
from support.moe_models import qwen3_moe
from torch import Tensor, nn

from pipeckpt import pipeline_of
from pipeckpt.boundaries.outside_uses import Handoffs, outside_uses
from pipeckpt.engines.distributed.handoffs import Withheld, standing_in, stands_in, unread_error, withheld

CPU = torch.device("cpu")
IDS = torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(0))  # the zoo's vocabulary
PP4 = [(0, 1), (1, 2), (2, 3), (3, 4)]


def _handoffs(model: nn.Module, layers: Tuple[str, ...], fake: bool = True, **call: Any) -> Handoffs:
    uses = outside_uses(pipeline_of(model, *layers), (), call, CPU, fake=fake)
    assert uses.handoffs is not None
    return uses.handoffs


def _zoo(name: str, **call: Any) -> Handoffs:
    model, layers = BUILDERS[name](0.0)
    return _handoffs(model, layers, **call)


def test_a_decoders_stage_sends_only_its_last_layers_output() -> None:
    h = _zoo("llama", input_ids=IDS, labels=IDS)
    assert h.sent(PP4) == (frozenset({(0, 0)}), frozenset({(1, 0)}), frozenset({(2, 0)}), frozenset())


def test_gpt2s_tied_head_changes_nothing_that_crosses() -> None:
    h = _zoo("gpt2", input_ids=IDS, labels=IDS)
    assert [h.crossing(b) for b in (1, 2, 3)] == [{(0, 0)}, {(1, 0)}, {(2, 0)}]


def test_t5s_decoder_stages_receive_the_encoders_last_output_and_the_position_biases() -> None:
    h = _zoo("t5", input_ids=IDS, labels=IDS)
    # layer 1 (the encoder's last) outputs the encoder's hidden state; the decoder's first layer
    # (2) outputs its hidden state, its self-attention bias and its cross-attention bias.
    assert h.counts == (2, 2, 3, 3)
    assert h.crossing(1) == {(0, 0), (0, 1)}  # the encoder's position bias rides on
    assert h.crossing(2) == {(1, 0)}  # the encoder's output, before the decoder's first layer
    assert h.crossing(3) == {(1, 0), (2, 0), (2, 1), (2, 2)}  # and again, for cross-attention


def test_an_moe_models_last_stage_receives_every_layers_router_logits() -> None:
    h = _handoffs(qwen3_moe(), ("model.layers",), fake=False, input_ids=IDS, labels=IDS)
    assert h.counts == (2, 2, 2, 2)  # the hidden state and the router logits
    assert h.crossing(1) == {(0, 0), (0, 1)}
    assert h.crossing(3) == {(2, 0), (0, 1), (1, 1), (2, 1)}  # the loss adds every router's up


class _MaskFromTheFirst(nn.Module):
    """Its forward compares the first layer's output with zero and hands the mask to the last layer:
    a read no gradient follows."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(4)])

    def forward(self, x: Tensor) -> Tensor:
        mask = None
        for i, layer in enumerate(self.layers):
            x = layer(x) if i < 3 else layer(x) * mask
            mask = (x > 0).float() if i == 0 else mask
        return x


def test_a_read_no_gradient_follows_crosses_to_every_later_stage() -> None:
    h = _handoffs(_MaskFromTheFirst(), ("layers",), x=torch.randn(2, 4))
    assert h.sent(PP4) == (
        frozenset({(0, 0)}),
        frozenset({(0, 0), (1, 0)}),
        frozenset({(0, 0), (2, 0)}),
        frozenset(),
    )


def test_the_boundary_alone_decides_what_crosses() -> None:
    h = _zoo("llama", input_ids=IDS)
    assert h.sent([(0, 2), (2, 4)])[0] == h.sent([(0, 1), (1, 2), (2, 4)])[1] == h.crossing(2)


def test_a_withheld_output_crosses_as_its_shape_and_comes_back_as_a_meta_tensor() -> None:
    produced = [(0, torch.ones(2, 3)), (1, (torch.zeros(2, 3, dtype=torch.float64), 5))]
    sent = withheld(produced, frozenset({(1, 0)}), counts=(1, 1))
    assert sent[0] == (0, Withheld((2, 3), torch.float32)) and sent[1][1][0] is produced[1][1][0]
    back = standing_in(sent)
    assert back[0][1].is_meta and back[0][1].shape == (2, 3) and back[0][1].dtype == torch.float32
    assert withheld(produced, None, counts=(1, 1)) is produced  # not probed: everything crosses


def test_computing_on_a_withheld_output_fails_by_name_not_on_made_up_values() -> None:
    received = standing_in([(0, Withheld((2, 3), torch.float32))])
    assert stands_in(received) and not stands_in([(0, torch.ones(2, 3))])
    try:
        torch.ones(2, 3) + received[0][1]  # a read the probe did not see
    except RuntimeError as error:
        assert "meta" in str(error)  # what the stage module tells such an error by
        message = str(unread_error("LlamaForCausalLM", 2, error))
    else:
        raise AssertionError("a real tensor and a meta stand-in computed together")
    assert "LlamaForCausalLM on pipeline stage 2" in message and "engine='local'" in message


def test_an_output_computed_from_a_stand_in_is_not_sent() -> None:
    # a Linear on a meta input and real weights gives meta, without an error of its own
    made = torch.nn.functional.linear(standing_in(Withheld((2, 3), torch.float32)), torch.ones(4, 3))
    try:
        withheld([(1, made)], frozenset({(1, 0)}), counts=(1, 1))
    except RuntimeError as error:
        assert "meta" in str(error) and "layer 1" in str(error)
    else:
        raise AssertionError("a meta tensor was let through to be sent")
