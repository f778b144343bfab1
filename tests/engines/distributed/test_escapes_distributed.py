"""Nothing leaves a stage silently under the distributed engine either (2 gloo processes,
tests/engines/distributed/escapes_worker.py): a layer of the first stage that appends its activation
to a list the loss reads, a forward hook that stores a pipeline_of layer's activation, or one that
keeps the very tensor the stage returns (and sends to the next process), would be lost there (the
last stage's process never runs that layer, so the loss it computes lacks the term). The first
stage's process refuses it at the first step, naming the layer; the other points to it; both exit.
The local engine's cases are in tests/stages/test_escapes.py."""

from pathlib import Path

import pytest
import support.ranks as ranks

WORKER = Path(__file__).resolve().parent / "escapes_worker.py"
START_S = 300
HANDS_OUT, KEEPS = (
    "hands out a tensor other than through",
    "keeps aside the very tensor its pipeline stage returns",
)
RUNS = [  # model, strategy, the layer named, what it is refused for
    (
        "sequential",
        dict(balance=[2, 2], chunks=2, schedule="1f1b", checkpoint="never", timeout=20),
        "layers.0",
        HANDS_OUT,
    ),
    (
        "hooked",
        dict(balance=[2, 2], chunks=2, schedule="gpipe", checkpoint="always", timeout=20),
        "model.blocks.1",
        HANDS_OUT,
    ),
    (
        "restored",
        dict(balance=[2, 2], chunks=2, schedule="1f1b", checkpoint="always", timeout=20),
        "model.blocks.1",
        KEEPS,
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize("model, strategy, layer, why", RUNS, ids=[r[0] for r in RUNS])
def test_the_first_stage_refuses_a_tensor_kept_aside_at_the_first_step(tmp_path, model, strategy, layer, why):
    codes = ranks.exit_codes(WORKER, 2, [dict(model=model, strategy=strategy)], tmp_path, within_s=START_S)
    output = ranks.logs(tmp_path, 2)
    assert codes == [1, 1], output
    assert "worker: trained" not in output
    first, last = (tmp_path / "rank0.log").read_text(), (tmp_path / "rank1.log").read_text()
    refusal = f"PipeckptConfigError: layer '{layer}' (pipeline stage 0) {why}"
    assert refusal in first, output
    # Rank 0 hosts the rendezvous store: the other either quotes its error or says it lost it.
    assert "pipeckpt: rank 0 (pipeline stage 0" in last or "lost rank 0" in last, output
