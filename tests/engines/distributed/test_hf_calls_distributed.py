"""Hugging Face's own calls under the distributed engine: GPT-2 and Llama (tiny random configs,
dropout 0) trained with ``self.model(**batch).loss`` or a keyword-only call, pipelined into 2
processes (gloo on CPU, tests/engines/distributed/distributed_hf_calls_worker.py), equal within 1e-5
to the unpipelined module. The micro-batches hold different numbers of label tokens, so the step's
loss must be weighted by them (a mean of the micro-batches' means is not the whole batch's)."""

from pathlib import Path
from typing import Any, Dict, Iterator, List

import pytest
import support.ranks as ranks
import torch
from test_distributed_pytree import _state
from torch.utils.data import DataLoader

pytest.importorskip("transformers")
from support.hf_models import STEPS, HFModule, batches
from support.toy import max_relative_difference

WORKER = Path(__file__).resolve().parent / "distributed_hf_calls_worker.py"
START_S = 480
TRAIN_STEPS = 2
TWO = dict(balance=[2, 2], chunks=4)
RUNS = [  # name, model, step, distributed settings
    ("gpt2_whole_gpipe", "gpt2", "whole", dict(TWO, schedule="gpipe", checkpoint="never")),
    ("gpt2_keywords_1f1b", "gpt2", "keywords", dict(TWO, schedule="1f1b", checkpoint="always")),
    ("llama_whole_1f1b", "llama", "whole", dict(TWO, schedule="1f1b", checkpoint="except_last")),
]


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> Iterator[Path]:
    runs: List[Dict[str, Any]] = [
        dict(name=n, model=m, step=s, strategy=st, steps=TRAIN_STEPS) for n, m, s, st in RUNS
    ]
    yield ranks.launch(WORKER, 2, runs, tmp_path_factory.mktemp("hf_calls"), within_s=START_S)


def _unpipelined(model: str, step: str) -> Dict[str, torch.Tensor]:
    module = HFModule(model, STEPS[step])
    ranks.quiet_trainer("auto", 1, max_steps=TRAIN_STEPS).fit(module, DataLoader(batches(), batch_size=None))
    return {k: v.detach() for k, v in module.state_dict().items()}


@pytest.mark.slow
@pytest.mark.parametrize("name, model, step, settings", RUNS, ids=[r[0] for r in RUNS])
def test_hf_calls_train_across_two_processes_like_the_unpipelined_module(
    two_processes, name, model, step, settings
):
    got = _state(two_processes / f"{name}.ckpt")["state_dict"]
    reference = _unpipelined(model, step)
    assert sorted(got) == sorted(reference)
    assert max_relative_difference({k: got[k] for k in reference}, reference) < 1e-5
