"""A training step's loss and logged values reach every rank of the pipeline exactly as the last
stage computed them, as objects only when the records' names, options or dtypes change; a stop
request of any rank reaches every rank's step boundary at the same step, in the same broadcast."""

import json
from pathlib import Path
from typing import Any, Dict, List

import pytest
from support import ranks

WORKER = Path(__file__).with_name("step_outcome_worker.py")


@pytest.fixture(scope="module")
def shared(tmp_path_factory: Any) -> List[Dict[str, Any]]:
    out = ranks.launch(WORKER, 2, [{}], tmp_path_factory.mktemp("outcome"), within_s=120)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
def test_every_rank_gets_the_last_stages_loss_and_records_bit_for_bit(shared: List[Dict[str, Any]]) -> None:
    first, last = shared
    assert first["seen"] == last["seen"]
    assert [s["loss"][1:] for s in first["seen"]] == [["torch.float32", []]] * len(first["seen"])


@pytest.mark.slow
def test_records_go_as_objects_only_when_their_names_options_or_dtypes_change(
    shared: List[Dict[str, Any]],
) -> None:
    # Steps: new, same, a name added, same, none, none, float64, float64 (float32 only go as values).
    assert shared[1]["objects"] == [True, False, True, False, True, False, True, True]
    assert shared[0]["objects"] == shared[1]["objects"]


@pytest.mark.slow
def test_a_stop_request_reaches_every_ranks_step_boundary_at_the_same_step(
    shared: List[Dict[str, Any]],
) -> None:
    assert shared[0]["stopped"] == shared[1]["stopped"]


@pytest.mark.slow
def test_the_last_stages_own_stop_request_is_read_at_its_step(shared: List[Dict[str, Any]]) -> None:
    # The last stage records its request during step 2, which its outcome carries.
    assert [i for i, s in enumerate(shared[1]["stopped"]) if i < 5 and s] == [2]


@pytest.mark.slow
def test_another_ranks_stop_request_is_read_at_its_step_or_the_next(shared: List[Dict[str, Any]]) -> None:
    # Rank 0 records its request during step 5 and posts it to the store; the last stage reads the
    # store before its broadcast, which may come before the post: then at step 6. Once either way.
    later = [i for i, s in enumerate(shared[1]["stopped"]) if i >= 5 and s]
    assert later in ([5], [6])
