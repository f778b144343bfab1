"""The one transformers name pipeckpt reaches that its documentation does not promise
(pipeckpt/_compat/transformers_private.py): an upgrade that removes or changes it fails here."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pipeckpt._compat.transformers_private import drop_tied_copies  # noqa: E402


def test_drop_tied_copies_keeps_the_input_embedding_of_a_meta_built_gpt2_and_drops_its_head():
    config = transformers.GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=1, n_head=2)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(config)
    state = model.state_dict()
    kept = drop_tied_copies(state, model)
    assert "lm_head.weight" in state and "lm_head.weight" not in kept
    assert set(kept) == set(state) - {"lm_head.weight"}
