"""The layout search counts a tensor-parallel layout's embedding and head as the engine splits them:
its plan is the engine's (the layers' and the model's own vocabulary entries), and the last stage
holds one rank's share of the logits (memory/vocab_share.py)."""

from typing import Any

import pytest

from pipeckpt import plan_layout
from pipeckpt.layout.candidates import Candidate

pytestmark = pytest.mark.usefixtures("one_thread")

LLAMA = (
    "model.config={model_type:llama,hidden_size:64,intermediate_size:176,num_hidden_layers:4,"
    "num_attention_heads:4,num_key_value_heads:2,vocab_size:2048,max_position_embeddings:64,"
    "tie_word_embeddings:false}"
)


def _cfg(*extra: str) -> Any:
    from hydra import compose, initialize_config_dir

    from pipeckpt.app.config import register
    from pipeckpt.plan import CONF

    register()
    overrides = ["model=hf", LLAMA, "model.seq_len=32", "data.batch_size=4", "strategy.engine=distributed"]
    overrides += ["trainer.devices=2", "strategy.layout=auto", "cluster=h100_8", *extra]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


def test_the_search_splits_the_embedding_and_head_as_the_engine_does() -> None:
    with plan_layout._searching(_cfg()) as (memory, _, _, _):
        plan = dict(memory.layout(Candidate(1, 2, 1, 1, "gpipe", 1, 1)).tp_plan)
        assert plan["lm_head"] == "colwise" and plan["model.embed_tokens"] == "rowwise"
        assert plan["self_attn.q_proj"] == "colwise"
        whole, split = memory.profile(1, 4), memory.profile(2, 4)
        assert whole.loss is not None and split.loss is not None
        logits = 4 * 32 * 2048 * 4  # one micro-batch of 4 x 32 tokens over the vocabulary, fp32
        # the loss link saves the vocabulary-shaped tensors whole at tp 1, half of each at tp 2
        saved = whole.bytes_of(set(whole.loss.saved)) - split.bytes_of(set(split.loss.saved))
        assert saved > 0 and saved % (logits // 2) == 0, saved
