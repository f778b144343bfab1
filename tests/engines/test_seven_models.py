"""The acceptance matrix of the models users bring: HF GPT-2, Llama, Qwen2, BERT (as a causal LM),
T5, Lightning's demo Transformer and a BatchNorm CNN (tests/support/seven_models.py), the HF ones
trained with their own ``self.model(**batch).loss``, pipelined into 2 stages of 2 micro-batches
under both engines and every mode (a per-stage list puts two modes in one run; ``auto`` plans
under a budget). Dropout 0: the trained weights are within 1e-5 of the unpipelined module (relative
to the largest weight; HF's token-mean losses combined by label tokens, the CNN's per-micro-batch
statistics as gradient accumulation). Dropout on: the distributed engine's weights are within 1e-5
of the local engine's. The distributed runs share one launch of 2 processes."""

from pathlib import Path
from typing import Any, Dict, Iterator, List

import pytest
import support.ranks as ranks
import torch
from support.seven_models import (
    NAMES,
    model_and_data,
    relative_difference,
    unpipelined_data,
    unpipelined_trainer_options,
    weights,
)
from support.trainers import quiet_trainer
from test_distributed_pytree import _state

from pipeckpt import PipelineStrategy

pytest.importorskip("transformers")

WORKER = Path(__file__).resolve().parent / "distributed" / "seven_models_worker.py"
START_S = 900  # every distributed run below, on a loaded 2-core machine
STEPS, CHUNKS = 2, 2
MODES: Dict[str, Any] = {  # run id -> the checkpoint setting (one mode per stage, or auto)
    "never+selective": ["never", "selective"],
    "except_last+always": ["except_last", "always"],
    "auto": "auto",
}
BUDGET = "1GiB"  # checkpoint='auto' plans under it (every plan fits: auto picks the fastest)
DROPOUT = 0.1


def settings(mode: str) -> Dict[str, Any]:
    checkpoint = MODES[mode]
    budget = dict(memory_budget=BUDGET) if checkpoint == "auto" else {}
    return dict(stages=2, chunks=CHUNKS, checkpoint=checkpoint, **budget)


def _trained(strategy: Any, name: str, *, dropout: float = 0.0) -> Dict[str, torch.Tensor]:
    module, data = model_and_data(name, dropout=dropout)
    torch.manual_seed(123)  # the same draws for dropout in every run
    quiet_trainer(strategy, max_steps=STEPS).fit(module, data)
    return weights(module)


@pytest.fixture(scope="module")
def unpipelined() -> Dict[str, Dict[str, torch.Tensor]]:
    out = {}
    for name in NAMES:
        module, data = model_and_data(name)
        trainer = quiet_trainer(max_steps=STEPS, **unpipelined_trainer_options(name, CHUNKS))
        trainer.fit(module, unpipelined_data(name, data, CHUNKS))
        out[name] = weights(module)
    return out


@pytest.fixture(scope="module")
def distributed(tmp_path_factory) -> Iterator[Path]:
    runs: List[Dict[str, Any]] = [
        dict(name=f"{n}_{m}", model=n, strategy=settings(m), steps=STEPS, dropout=0.0)
        for n in NAMES
        for m in MODES
    ]
    runs += [
        dict(name=f"{n}_dropout", model=n, strategy=settings("never+selective"), steps=STEPS, dropout=DROPOUT)
        for n in NAMES
    ]
    yield ranks.launch(WORKER, 2, runs, tmp_path_factory.mktemp("seven"), within_s=START_S)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", NAMES)
def test_each_model_trains_under_the_local_engine_like_the_unpipelined_module(unpipelined, name, mode):
    got = _trained(PipelineStrategy(**settings(mode)), name)
    assert relative_difference(got, unpipelined[name]) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", NAMES)
def test_each_model_trains_under_the_distributed_engine_like_the_unpipelined_module(
    distributed, unpipelined, name, mode
):
    state = _state(distributed / f"{name}_{mode}.ckpt")["state_dict"]
    reference = unpipelined[name]
    assert relative_difference({k: state[k] for k in reference}, reference) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)  # T5 draws dropout in its own code between its layers too
def test_with_dropout_on_the_distributed_engine_draws_what_the_local_engine_draws(distributed, name):
    local = _trained(PipelineStrategy(**settings("never+selective")), name, dropout=DROPOUT)
    state = _state(distributed / f"{name}_dropout.ckpt")["state_dict"]
    assert relative_difference({k: state[k] for k in local}, local) < 1e-5
