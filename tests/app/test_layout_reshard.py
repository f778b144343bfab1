"""The search weighs FSDP's ``reshard_after_forward`` as a lever of its own: freed after each forward,
a rank holds two layers' gathered parameters rather than its stage's whole share, and gathers them
again for every forward and backward (docs/MEMORY.md, "Per rank under FSDP2, TP and PP")."""

import pytest
from support.layout_configs import llama_search

from pipeckpt import plan_layout
from pipeckpt.layout import cost
from pipeckpt.layout.candidates import Candidate

pytestmark = pytest.mark.usefixtures("one_thread")


def test_resharding_after_forward_holds_less_and_takes_longer_than_keeping_gathered() -> None:
    cfg = llama_search("cluster=h100_8")
    with plan_layout._searching(cfg) as (memory, _, where, shapes):
        kept, freed = (Candidate(1, 1, 1, 2, "gpipe", 1, 1, reshard=r) for r in (False, True))
        assert memory.fit(freed).peaks[0] < memory.fit(kept).peaks[0]
        estimate = plan_layout._cost(cfg, memory, where, shapes).estimate
        assert estimate(freed).step_s > estimate(kept).step_s
        # the estimate is the cost model's with the candidate's own policy
        assert (
            estimate(freed).step_s
            == cost.estimate(
                freed,
                cost.model_costs_from_config(
                    shapes.built(1).module.hf_config, seq_len=32, precision="32-true"
                ),
                where,
                global_batch=4,
                seq_len=32,
                precision="32-true",
                reshard_after_forward=True,
            ).step_s
        )
