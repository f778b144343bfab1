"""A model no tensor-parallel plan splits is searched without tensor parallelism: an HF GPT-2 (its
layers are Conv1D, and its config has no ``base_model_tp_plan``) was offered tp 2 on a preset and
on ``cluster=local``, and the whole search ended on the plan's refusal of a degree never set."""

from typing import Any, List, Tuple

import pytest
from support.local_cluster import FIGURES

from pipeckpt import plan_layout, plan_model, plan_shapes
from pipeckpt.layout import calibrate

pytestmark = pytest.mark.usefixtures("one_thread")

GPT2 = "model.config={model_type:gpt2,n_embd:32,n_head:2,n_layer:%d,vocab_size:256,n_positions:64}"


def _gpt2_search(*extra: str, layers: int = 2) -> Any:
    from hydra import compose, initialize_config_dir

    from pipeckpt.app.config import register
    from pipeckpt.plan import CONF

    register()
    overrides = ["model=hf", GPT2 % layers, "model.seq_len=32", "data.batch_size=4", "data.max_bytes=200000"]
    overrides += ["strategy.engine=distributed", "trainer.devices=2", "strategy.layout=auto", *extra]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


@pytest.mark.parametrize("where", ["cluster=h100_8", "cluster=local"])
def test_an_hf_gpt2_is_searched_without_tensor_parallelism(
    where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(calibrate, "measured", lambda: dict(FIGURES))
    answer = plan_layout.search_config(_gpt2_search(where, "threads=1"))
    assert answer.searched.ranked and all(r.candidate.tp == 1 for r in answer.searched.ranked)
    assert {r.candidate.pp for r in answer.searched.ranked} == {1, 2}


def test_an_hf_gpt2_is_profiled_on_three_of_its_layers_with_the_same_ranking(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # its config counts its layers as n_layer: each micro-batch size was profiled on every layer
    shortened: List[int] = []

    def three(cfg: Any, full: Any) -> Any:
        short = plan_model.three_layers(cfg, full)
        shortened.append(short.model.config.n_layer)
        return short

    def ranking(answer: Any) -> List[Tuple[Any, ...]]:
        return [(r.candidate, r.fitted.peaks, r.estimate.step_s) for r in answer.searched.ranked]

    monkeypatch.setattr(plan_shapes, "three_layers", three)
    short = ranking(plan_layout.search_config(_gpt2_search("cluster=h100_8", layers=5)))
    assert shortened and set(shortened) == {3}
    monkeypatch.setattr(plan_shapes, "three_layers", lambda cfg, full: None)
    whole = ranking(plan_layout.search_config(_gpt2_search("cluster=h100_8", layers=5)))
    # the same layouts in the same order at the same predicted steps, and every rank's peak within
    # 4 KiB. Alone the peaks are equal to the byte; after this file's searches in the same process one
    # layer's counted backward working set came out apart (4 KiB, 2026-12-02, also in CI). Fake
    # tensors' dispatch cache, shared by the process, was one cause (profiles now run without it:
    # pipeckpt/_compat/torch_private.py); after an h100_8 then a local search 256 bytes remain, from
    # a state not yet found
    assert [(c, t) for c, _, t in short] == [(c, t) for c, _, t in whole]
    for (_, mine, _), (_, theirs, _) in zip(short, whole, strict=True):
        assert mine == pytest.approx(theirs, rel=0, abs=4096)
