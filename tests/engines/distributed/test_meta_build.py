"""Stages built on the meta device under the distributed engine: one launch of 2 real processes
(gloo on CPU, tests/engines/distributed/meta_build_worker.py) trains the toy module (Linear and
BatchNorm layers) 3 steps as pp2, built eagerly, in ``configure_model`` and under
``trainer.init_module(empty_init=True)``, then tries a module with a layer that cannot initialise
itself. Each rank holds for real exactly its stage's tensors, whose initial values equal an eager
build with the same seed bitwise; the trained weights are within 1e-5 relative of the eager-built
run's; the uninitialisable module is refused on every rank, by the layer's name, before a step."""

import functools
from pathlib import Path
from typing import Any, Dict, Iterator

import pytest
import support.ranks as ranks
import torch
from meta_build_worker import SEED
from support.meta_models import eager_layers
from support.toy import assert_bitwise_equal, max_relative_difference

HERE = Path(__file__).resolve().parent
WORKER = HERE / "meta_build_worker.py"
WORLD = 2
START_S = 240  # 2 processes, 4 short fits, on a loaded 2-core machine
BALANCE = [3, 3]
RUNS = [
    dict(name="eager", build="eager", balance=BALANCE),
    dict(name="configure_model", build="configure_model", balance=BALANCE),
    dict(name="init_module", build="init_module", balance=BALANCE),
    dict(name="uninitialisable", build="uninitialisable", balance=[3, 4]),
]
BUILT_ON_META = ("configure_model", "init_module")


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> Iterator[Path]:
    yield ranks.launch(WORKER, WORLD, RUNS, tmp_path_factory.mktemp("meta_build"), within_s=START_S)


def _saved(out: Path, run: str, rank: int) -> Dict[str, Any]:
    return torch.load(out / f"{run}_rank{rank}.pt", weights_only=True)


@functools.cache
def _eager() -> Dict[str, torch.Tensor]:
    return {f"layers.{k}": v for k, v in eager_layers(SEED).state_dict().items()}


def _stage_keys(rank: int) -> set:
    first, stop = sum(BALANCE[:rank]), sum(BALANCE[: rank + 1])
    return {k for k in _eager() if first <= int(k.split(".")[1]) < stop}


@pytest.mark.slow
@pytest.mark.parametrize("run", BUILT_ON_META)
def test_no_rank_ever_holds_the_whole_model_only_its_stages_tensors(two_processes, run):
    for rank in range(WORLD):
        saved = _saved(two_processes, run, rank)
        assert saved["when_built"] == 0  # built on meta
        held = saved["at_start"]
        assert set(held) == _stage_keys(rank)
        assert sum(t.numel() for t in held.values()) < sum(t.numel() for t in _eager().values())


@pytest.mark.slow
@pytest.mark.parametrize("run", BUILT_ON_META)
def test_initial_weights_equal_an_eager_build_with_the_same_seed(two_processes, run):
    for rank in range(WORLD):
        held = _saved(two_processes, run, rank)["at_start"]
        assert_bitwise_equal(held, {k: _eager()[k] for k in held})


@pytest.mark.slow
@pytest.mark.parametrize("run", BUILT_ON_META)
def test_training_matches_the_eager_built_run(two_processes, run):
    for rank in range(WORLD):
        trained = _saved(two_processes, run, rank)["trained"]
        eager = _saved(two_processes, "eager", rank)["trained"]
        counts = [k for k in eager if not eager[k].is_floating_point()]  # BatchNorm's batches seen
        assert_bitwise_equal({k: trained.pop(k) for k in counts}, {k: eager.pop(k) for k in counts})
        assert max_relative_difference(trained, eager) <= 1e-5


@pytest.mark.slow
def test_a_layer_that_cannot_initialise_itself_is_refused_on_every_rank_before_a_step(two_processes):
    for rank in range(WORLD):
        saved = _saved(two_processes, "uninitialisable", rank)
        assert "self.layers.6 (Gain, holding gain) is on the meta device" in saved["error"]
        assert "HINT: give Gain a reset_parameters()" in saved["error"]
        assert saved["steps"] == 0
