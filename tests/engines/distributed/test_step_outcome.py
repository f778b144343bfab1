"""A training step's loss and logged values reach every rank of the pipeline exactly as the last
stage computed them, as objects only when the records' names, options or dtypes change; a stop
request of any rank rides on the same messages to every rank."""

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
def test_a_stop_request_of_any_rank_reaches_every_ranks_step_boundary_with_the_steps_outcome(
    shared: List[Dict[str, Any]],
) -> None:
    # The last stage records a request during step 2, rank 0 during step 5: both boundaries read
    # each at its step, and only there.
    expected = [i in (2, 5) for i in range(8)]
    assert shared[0]["stopped"] == expected
    assert shared[1]["stopped"] == expected
