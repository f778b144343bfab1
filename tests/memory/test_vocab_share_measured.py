"""The last stage's predicted peak under pp2 x tp2, with the LM head split over the vocabulary
(memory/vocab_share.py), against the bytes its ranks held in a measured training step.

Measured by the layout benchmark's harness (benchmarks/harness/layout_fit.py through
``bench_layout_measured.py``'s worker, on 4 gloo processes of one thread): the app's HF Llama
(vocabulary 32000, hidden 128, 4 layers: its logits, 4 x 128 x 32000 fp32 per micro-batch, are most
of the last stage's memory) trained one warm-up, one timed and one counted step, GPipe over 2
micro-batches of 4, ``never``, AdamW; each rank's peak is every storage alive in the counted step
(DTensors by their local shards). Predicted by ``python -m pipeckpt.plan ... memory.tp=2`` on the
same configuration. The bar: at or over the measured peak and within 15% of it (memory is exact
on CPU, so this holds on any load). 2026-12-02: the plan said 232.25 MiB against 203.38 measured
(+14.2%), with the layers' activations profiled whole; 2026-12-04, profiled on one rank's cut of
the layers (memory/tp_local.py) as the layout search does: 226.23 (+11.2%). Earlier the
measurement also counted the other stage's parameters, left on the meta device (16.2 MiB more):
219.6 against 231.75 then, two errors that cancelled. Before the
split was counted the plan said 294.25, and 169.25 with it but without the logits torch's
PipelineStage keeps per micro-batch. Of the 29 MiB over, about one logits shard (31.25 MiB) is
likely the loss backward's working memory, which the plan counts as the whole head's backward makes
it; not yet measured apart."""

from typing import List

import pytest
from support.measured_peaks import measured_peaks

from pipeckpt.plan import main
from pipeckpt.sizes import MiB

pytestmark = pytest.mark.usefixtures("one_thread")

LLAMA = (
    "model.config={model_type:llama,hidden_size:128,intermediate_size:256,num_hidden_layers:4,"
    "num_attention_heads:4,num_key_value_heads:2,vocab_size:32000}"
)
CASE = ["model=hf", LLAMA, "data.max_bytes=400000"]
BATCH, TP = 8, 2
PICK = {
    "engine": "distributed",
    "stages": 2,
    "balance": None,
    "dp": 1,
    "virtual_stages": 1,
    "schedule": "gpipe",
    "chunks": 2,
    "data_parallel": "fsdp",
    "dp_shard": None,
    "tensor_parallel": TP,
    "checkpoint": ["never", "never"],
}
TOLERANCE = 0.15  # over the measured peak


def _measured() -> List[int]:
    """Each pipeline rank's peak bytes: the most any of its tensor-parallel ranks held."""
    return measured_peaks(CASE, PICK, world=2 * TP, batch=BATCH)


def _predicted(capsys: pytest.CaptureFixture[str]) -> List[float]:
    """Each stage's predicted peak on one of its ranks, MiB, as the plan prints it."""
    args = [
        *CASE,
        "strategy.engine=distributed",
        "strategy.stages=2",
        "strategy.chunks=2",
        "ckpt=never",
        f"data.batch_size={BATCH}",
        f"memory.tp={TP}",
    ]
    assert main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.split()[:3] == ["stage", "layers", "mode"])
    column = lines[at].split().index("peak")
    return [float(line.split()[column]) for line in lines[at + 1 : at + 3]]


@pytest.mark.slow
def test_under_pp2_tp2_the_last_stages_predicted_peak_bounds_the_measured_within_fifteen_percent(
    capsys: pytest.CaptureFixture[str],
) -> None:
    predicted = _predicted(capsys)[1] * MiB
    measured = _measured()[1]
    assert measured <= predicted <= (1 + TOLERANCE) * measured, (predicted / MiB, measured / MiB)
