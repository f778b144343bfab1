"""The layout search counts a tensor-parallel layout's embedding and head as the engine splits them:
its plan is the engine's (the layers' and the model's own vocabulary entries), and the last stage
holds one rank's share of the logits (memory/vocab_share.py)."""

import pytest
from support.layout_configs import llama_search

from pipeckpt import plan_layout
from pipeckpt.layout.candidates import Candidate

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_search_splits_the_embedding_and_head_as_the_engine_does() -> None:
    with plan_layout._searching(llama_search("cluster=h100_8", vocab=2048)) as (memory, _, _, _):
        plan = dict(memory.layout(Candidate(1, 2, 1, 1, "gpipe", 1, 1)).tp_plan)
        assert plan["lm_head"] == "colwise" and plan["model.embed_tokens"] == "rowwise"
        assert plan["self_attn.q_proj"] == "colwise"
        whole, split = memory.profile(1, 4), memory.profile(2, 4)
        assert whole.loss is not None and split.loss is not None
        logits = 4 * 32 * 2048 * 4  # one micro-batch of 4 x 32 tokens over the vocabulary, fp32
        # the loss link saves the vocabulary-shaped tensors whole at tp 1, half of each at tp 2
        saved = whole.bytes_of(set(whole.loss.saved)) - split.bytes_of(set(split.loss.saved))
        assert saved > 0 and saved % (logits // 2) == 0, saved


@pytest.mark.parametrize("stages", [1, 2], ids=["pp1", "pp2"])
def test_the_search_and_the_plan_command_predict_a_tp2_ranks_peak_alike(stages: int) -> None:
    """The layout search's memory function and ``python -m pipeckpt.plan memory.tp=2`` reach a rank's
    peak by two paths (the search's per-rank states, the plan's rank table); for the same layout
    they agree to the byte. Until 2026-12-05 the search counted the embedding and head whole on the
    ranks that hold them (benchmarks/RESULTS_layout.md, "The embedding and head counted once")."""
    from support.layout_configs import LLAMA

    from pipeckpt.plan import run

    candidate = Candidate(stages, 2, 1, 1, "gpipe", 1, 2, ("never",))
    searched = plan_layout.search_config(
        llama_search("cluster=h100_8", f"trainer.devices={2 * stages}"), only=[candidate]
    )
    planned, _, _ = run(
        [
            "model=hf", LLAMA % (64, 4, 2, 512), "model.seq_len=32", "data.batch_size=4", "ckpt=never",
            "strategy.engine=distributed", f"strategy.stages={stages}", "strategy.chunks=2",
            "strategy.schedule=gpipe", "strategy.tensor_parallel=2", "strategy.data_parallel=fsdp",
            f"trainer.devices={2 * stages}", "memory.tp=2",
        ]
    )  # fmt: skip
    assert searched.searched.ranked[0].fitted.peaks == tuple(r.peak for r in planned.ranks)
