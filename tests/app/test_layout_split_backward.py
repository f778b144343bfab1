"""The search prices a zero-bubble schedule's split backward as the engine runs the model's stages:
timed on the app's GPT (a Sequential) and on a ``pipeline_of`` model's chain, whose stages split too
(the engine's weight passes add a rooted model's layer gradients:
tests/engines/distributed/test_distributed_zero_bubble.py)."""

from pathlib import Path
from typing import Any, List

import pytest
from support.local_cluster import priced_costs

from pipeckpt.layout.split_backward import HALVES
from pipeckpt.plan import CONF
from pipeckpt.plan_model import batch, built, split_timed

pytestmark = pytest.mark.usefixtures("one_thread")

LLAMA = (
    "model.config={model_type:llama,hidden_size:64,intermediate_size:176,num_hidden_layers:2,"
    "num_attention_heads:4,num_key_value_heads:2,vocab_size:512,max_position_embeddings:64}"
)


def _compose(overrides: List[str]) -> Any:
    from hydra import compose, initialize_config_dir

    from pipeckpt.app.config import register

    register()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


def test_the_local_search_prices_the_apps_gpt_split_as_timed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from pipeckpt.plan import run

    priced = priced_costs(monkeypatch)
    run(
        [
            "model=gpt",
            "strategy.engine=distributed",
            "trainer.devices=2",
            "strategy.layout=auto",
            "cluster=local",
            f"memory.png={tmp_path / 'frontier.png'}",
        ]
    )
    split = priced[0].split_backward
    assert split.splits and split is not HALVES and split.factor > 0
    assert 0.0 < split.input_share < 1.0


def test_a_pipeline_of_models_split_is_timed_on_its_chain() -> None:
    cfg = _compose(["model=hf", LLAMA, "model.seq_len=16", "data.batch_size=4", "data.max_bytes=20000"])
    with built(cfg, batch(cfg), fake=False) as b:
        kept = [p.grad for p in b.module.parameters()]
        split = split_timed(cfg, b, 2)
        assert all(p.grad is g for p, g in zip(b.module.parameters(), kept))  # left as found
    assert split.splits and split is not HALVES and split.factor > 0
    assert 0.0 < split.input_share < 1.0
