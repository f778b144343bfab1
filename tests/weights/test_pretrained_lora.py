"""PEFT LoRA on a model built on the meta device and filled from a pretrained directory
(:func:`pipeckpt.pretrained`), under the local engine: the base weights start bitwise at
``from_pretrained(dir, dtype=float32)`` whether the mark is on the base model before wrapping or on the
``PeftModel`` after; the adapters, which the directory lacks, are initialised by PEFT's rule (B zero)
instead of being reported missing; 3 steps change the adapters only; the exported adapters load with
``PeftModel.from_pretrained`` equal to the trained ones. pp2 x fsdp2:
tests/engines/distributed/test_pretrained_lora_distributed.py."""

from typing import Any, Dict

import lightning as L
import pytest
import torch

pytest.importorskip("peft")
from peft import PeftModel
from support.pretrained_lora import LoraFromPretrained, base_key, is_adapter
from support.pretrained_models import loader, reference, save
from support.trainers import quiet_trainer

from pipeckpt import PipeckptConfigError, PipelineStrategy
from pipeckpt.export import HFExport


class AtStart(L.Callback):
    def __init__(self) -> None:
        self.held: Dict[str, torch.Tensor] = {}

    def on_fit_start(self, trainer: Any, module: Any) -> None:
        self.held = {k: v.detach().clone() for k, v in module.model.state_dict().items()}


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    return save("llama", tmp_path_factory.mktemp("lora") / "llama")


def _fit(directory, mark: str = "base", **options: Any):
    module, at_start = LoraFromPretrained(directory, mark), AtStart()
    trainer = quiet_trainer(
        PipelineStrategy(balance=[2, 2], chunks=2),
        max_steps=3,
        callbacks=[at_start, *options.pop("callbacks", [])],
    )
    trainer.fit(module, loader())
    return module, at_start.held, trainer


@pytest.fixture(scope="module")
def trained(directory, tmp_path_factory):
    export = tmp_path_factory.mktemp("export") / "adapter"
    module, at_start, _ = _fit(directory, callbacks=[HFExport(export)])
    return module, at_start, export


def test_the_base_starts_bitwise_at_from_pretrained_and_lora_b_at_zero(directory, trained):
    _, at_start, _ = trained
    want = reference(directory).state_dict()
    base = {base_key(k): v for k, v in at_start.items() if not is_adapter(k)}
    assert base.keys() == want.keys()
    assert all(torch.equal(v, want[k]) for k, v in base.items())
    lora_b = [v for k, v in at_start.items() if ".lora_B." in k]
    lora_a = [v for k, v in at_start.items() if ".lora_A." in k]
    assert len(lora_b) == len(lora_a) == 8  # q and v of 4 layers
    assert all(not v.any() for v in lora_b) and all(v.isfinite().all() and v.any() for v in lora_a)


def test_three_steps_change_the_adapters_only(trained):
    module, at_start, _ = trained
    after = module.model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in at_start.items() if not is_adapter(k))
    assert all(not torch.equal(after[k], v) for k, v in at_start.items() if ".lora_B." in k)


def test_a_mark_on_the_peft_model_after_wrapping_reads_the_same_base(directory, trained):
    _, at_start_base, _ = trained
    _, at_start_peft, _ = _fit(directory, mark="peft")
    assert at_start_peft.keys() == at_start_base.keys()
    assert all(torch.equal(at_start_peft[k], v) for k, v in at_start_base.items() if not is_adapter(k))


def test_the_exported_adapters_load_with_peft_equal_to_the_trained_ones(directory, trained):
    module, _, export = trained
    loaded = PeftModel.from_pretrained(reference(directory), export).state_dict()
    adapters = {k: v for k, v in module.model.state_dict().items() if is_adapter(k)}
    assert adapters and all(torch.equal(loaded[k], v) for k, v in adapters.items())


def test_an_adapter_init_that_needs_an_eager_build_is_refused_naming_it(directory):
    module = LoraFromPretrained(directory, init_lora_weights=False)
    trainer = quiet_trainer(PipelineStrategy(balance=[2, 2], chunks=2), max_steps=1)
    with pytest.raises(PipeckptConfigError, match="init_lora_weights=False"):
        trainer.fit(module, loader())
