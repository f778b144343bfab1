"""The same seed gives the same numbers under both engines: a user's script seeded with
``seed_everything`` trains under engine="distributed" (2 processes, 1 replica) as under the local
engine, dropout on, within 1e-5 relative per tensor.

- HF GPT-2 with embedding dropout (drawn by the model's own code, outside the named layers, from the
  caller's generator: the distributed engine must not reseed it);
- HF Llama with attention dropout (a float handed to ``scaled_dot_product_attention``, which
  ``layer_rng='auto'`` must find);
- a loader built with ``shuffle=False``: the ``DistributedSampler`` Lightning puts in reads it in
  order; a shuffled loader is still shuffled, the same on every rank of the pipeline.

One launch of 2 real processes (gloo on CPU, distributed_same_numbers_worker.py) runs every training;
the local engine's run is made in this process.
"""

import json
from pathlib import Path
from typing import Any, Dict, Iterator, List

import pytest
import support.ranks as ranks
import torch
from distributed_same_numbers_worker import build
from support.toy import max_relative_difference
from support.trainers import quiet_trainer
from test_distributed_pytree import _state

from pipeckpt import PipelineStrategy

pytest.importorskip("transformers")

WORKER = Path(__file__).resolve().parent / "distributed_same_numbers_worker.py"
START_S = 480
TOLERANCE = 1e-5  # relative, per tensor: the distributed engine sums micro-batch gradients aside
TWO = dict(balance=[2, 2], chunks=4)
ALWAYS_1F1B = dict(TWO, schedule="1f1b", checkpoint="always")
NEVER_GPIPE = dict(TWO, schedule="gpipe", checkpoint="never")
RUNS: List[Dict[str, Any]] = [  # the distributed runs; each local reference: balance, chunks, never
    dict(name="gpt2_dropout", model="gpt2", steps=3, strategy=ALWAYS_1F1B),
    dict(name="llama_dropout", model="llama", steps=3, strategy=NEVER_GPIPE),
    dict(
        name="toy_in_order",
        model="toy",
        steps=8,  # two epochs of 4 batches
        sampler=True,
        strategy=dict(balance=[3, 3], chunks=4, schedule="1f1b", checkpoint="except_last"),
    ),
    dict(name="toy_shuffled", model="toy", steps=1, sampler=True, shuffle=True, strategy={"balance": [3, 3]}),
]
BY_NAME = {r["name"]: r for r in RUNS}


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> Iterator[Path]:
    yield ranks.launch(WORKER, 2, RUNS, tmp_path_factory.mktemp("same_numbers"), within_s=START_S)


def _local(name: str) -> Dict[str, torch.Tensor]:
    run = BY_NAME[name]
    module, loader = build(run["model"], run.get("shuffle", False))
    strategy = PipelineStrategy(balance=run["strategy"]["balance"], chunks=4, checkpoint="never")
    quiet_trainer(strategy, max_steps=run["steps"]).fit(module, loader)
    return {k: v.detach() for k, v in module.state_dict().items()}


def _sampler(out: Path, name: str, rank: int) -> Dict[str, Any]:
    return json.loads((out / f"{name}.rank{rank}.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2_dropout", "llama_dropout"])
def test_a_hf_model_with_dropout_on_trains_as_under_the_local_engine(two_processes, name):
    got = _state(two_processes / f"{name}.ckpt")["state_dict"]
    reference = _local(name)
    assert sorted(got) == sorted(reference)
    assert max_relative_difference({k: got[k] for k in reference}, reference) < TOLERANCE


@pytest.mark.slow
def test_a_loader_without_shuffle_is_read_in_order_and_trains_as_under_the_local_engine(two_processes):
    for rank in (0, 1):  # one replica: the sampler spans the replicas, not the pipeline's processes
        seen = _sampler(two_processes, "toy_in_order", rank)
        assert (seen["sampler"], seen["shuffle"], seen["num_replicas"]) == ("DistributedSampler", False, 1)
        assert seen["order"] == list(range(64))
    got = _state(two_processes / "toy_in_order.ckpt")["state_dict"]
    assert max_relative_difference(got, _local("toy_in_order")) < TOLERANCE


@pytest.mark.slow
def test_a_shuffled_loader_is_still_shuffled_the_same_on_every_rank_of_the_pipeline(two_processes):
    first, second = (_sampler(two_processes, "toy_shuffled", rank) for rank in (0, 1))
    assert first["shuffle"] is True and first["order"] == second["order"]
    assert sorted(first["order"]) == list(range(64)) and first["order"] != list(range(64))
