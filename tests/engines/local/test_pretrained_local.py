"""Fine-tuning from a pretrained directory under the local engine: the model built on the meta
device in ``configure_model`` and filled from a bf16 directory in many shards starts bitwise at
``from_pretrained(dir, dtype=float32)``, trains as that eagerly-built module does (within 1e-5),
and a resume takes precedence over the directory's weights. Built on meta from its config alone, a
Llama or Qwen2 starts and trains bitwise as the eager build with the same seed."""

from typing import Any, Dict

import lightning as L
import pytest
import torch
from support.pretrained_models import FromPretrained, FromScratch, loader, reference, save
from support.toy import assert_bitwise_equal, max_relative_difference, params
from support.trainers import quiet_trainer

from pipeckpt import PipelineStrategy

pytestmark = pytest.mark.usefixtures("one_thread")


class AtStart(L.Callback):
    def __init__(self) -> None:
        self.weights: Dict[str, torch.Tensor] = {}

    def on_fit_start(self, trainer: Any, module: Any) -> None:
        self.weights = {k: v.detach().clone() for k, v in module.model.state_dict().items()}


def _fit(module: L.LightningModule, steps: int = 3, **options: Any) -> AtStart:
    at_start = AtStart()
    strategy = PipelineStrategy(balance=[2, 2], chunks=2)
    torch.manual_seed(0)
    trainer = quiet_trainer(strategy, max_steps=steps, callbacks=[at_start], **options)
    trainer.fit(module, loader())
    return at_start


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def saved(request, tmp_path_factory):
    return request.param, save(request.param, tmp_path_factory.mktemp(request.param))


def test_a_module_filled_from_the_directory_starts_at_from_pretrained_bitwise(saved):
    name, path = saved
    module = FromPretrained(name, path)
    at_start = _fit(module, steps=1)
    assert_bitwise_equal(at_start.weights, reference(path).state_dict())
    if name == "gpt2":
        assert module.model.lm_head.weight is module.model.transformer.wte.weight


def test_fine_tuning_matches_the_module_from_pretrained_built_eagerly(saved):
    name, path = saved
    built = FromPretrained(name, path)
    _fit(built)
    eager = FromPretrained(name, path, build="eager")
    _fit(eager)
    assert max_relative_difference(params(built), params(eager)) <= 1e-5


def test_a_resume_takes_precedence_over_the_directorys_weights(saved, tmp_path):
    name, path = saved
    first = FromPretrained(name, path)
    trainer = quiet_trainer(PipelineStrategy(balance=[2, 2], chunks=2), max_steps=2)
    trainer.fit(first, loader())
    trainer.save_checkpoint(tmp_path / "run.ckpt")
    other = save(name, tmp_path / "other", seed=9)  # another directory: its weights must not win
    resumed = FromPretrained(name, other)
    trainer = quiet_trainer(PipelineStrategy(balance=[2, 2], chunks=2), max_steps=2)
    trainer.fit(resumed, loader(), ckpt_path=tmp_path / "run.ckpt")  # nothing left to train
    assert_bitwise_equal(params(resumed), params(first))


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_a_model_built_on_meta_from_its_config_trains_bitwise_as_the_eager_build(name):
    built = FromScratch(name)
    at_start = _fit(built)
    eager = FromScratch(name, build="eager")
    eager_start = _fit(eager)
    assert_bitwise_equal(at_start.weights, eager_start.weights)
    assert_bitwise_equal(params(built), params(eager))


def test_a_module_built_under_init_module_empty_init_is_filled_alike(saved):
    name, path = saved
    at_start = AtStart()
    trainer = quiet_trainer(PipelineStrategy(balance=[2, 2], chunks=2), max_steps=1, callbacks=[at_start])
    with trainer.init_module(empty_init=True):
        module = FromPretrained(name, path)
        module.configure_model()  # built here, on the meta device
    assert all(p.is_meta for p in module.parameters())
    trainer.fit(module, loader())
    assert_bitwise_equal(at_start.weights, reference(path).state_dict())
