"""checkpoint='auto' on any model the strategy takes: ``pipeline_of`` models profiled from their own
input, the sample batch from the loader passed to ``fit``, the optimizer from ``configure_optimizers``."""

from typing import Any, Dict, List

import pytest
import torch
from support.hf_models import HFModule, batches, whole
from support.toy import ToyModule, toy_loader
from support.trainers import quiet_trainer
from torch import Tensor
from torch.utils.data import DataLoader

from pipeckpt import PipelineStrategy, pipeline_of
from pipeckpt._errors import PipeckptConfigError
from pipeckpt.memory.budget import fitted_optimizer, resolve_auto
from pipeckpt.memory.profile import profile
from pipeckpt.memory.rooted import RootInput
from pipeckpt.settings import PipeSettings

CPU = [torch.device("cpu")]

#: Budgets below the models' predicted peak without checkpointing (GPT-2 1.7 MiB, Llama 1.2 MiB for
#: both stages of 2 micro-batches on the one CPU) and above their least (0.6 MiB, 0.5 MiB).
BUDGETS = {"gpt2": "1MiB", "llama": "800KiB"}


pytestmark = pytest.mark.usefixtures("one_thread")


def _trained_alone(name: str, data: List[Dict[str, Tensor]]) -> Dict[str, Tensor]:
    module = HFModule(name, whole)
    optimizer = module.configure_optimizers()
    for batch in data:
        optimizer.zero_grad()
        whole(module.model, batch).backward()
        optimizer.step()
    return module.state_dict()


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_a_pipeline_of_hf_model_plans_from_its_loader_and_trains_like_the_unpipelined_model(name) -> None:
    data = batches(2)
    expected = _trained_alone(name, data)
    strategy = PipelineStrategy(stages=2, chunks=2, checkpoint="auto", memory_budget=BUDGETS[name])
    module = HFModule(name, whole)
    quiet_trainer(strategy, max_steps=2).fit(module, DataLoader(data, batch_size=None))
    assert any(m.checkpoints for m in strategy.plan.modes)  # the budget is below never's peak
    assert strategy.auto_plan.choice.process_peak <= strategy.auto_plan.budget
    got = module.state_dict()
    worst = max((got[k] - v).abs().max().item() for k, v in expected.items())
    assert worst <= 1e-5


def test_a_pipeline_of_model_is_profiled_from_token_ids_through_its_own_forward() -> None:
    module = HFModule("gpt2", whole)
    ids = batches(1)[0]["input_ids"]
    fitted = profile(pipeline_of(module.model, "transformer.h"), ids[:2], rounds=1)
    assert [layer.name for layer in fitted.layers] == ["GPT2Block"] * 4
    assert fitted.microbatch_size == 2
    # The embeddings, final norm and head (the model's parameters outside its blocks) count once,
    # after the last block, as a Sequential's loss does.
    blocks = {id(p) for p in module.model.transformer.h.parameters()}
    outside = sum(p.numel() * 4 for p in module.model.parameters() if id(p) not in blocks)
    assert fitted.loss is not None and fitted.loss.param_bytes == outside


def test_auto_plans_a_pipeline_of_model_from_an_example_input_array_of_token_ids() -> None:
    module = HFModule("llama", whole)
    ids = batches(1)[0]["input_ids"]
    settings = PipeSettings(stages=2, chunks=2, checkpoint="auto", memory_budget="1GiB")
    auto = resolve_auto(settings, module.configure_pipeline(), devices=CPU, batch=RootInput.of(ids))
    assert auto.choice.balance == (2, 2)
    assert auto.profiles[2].microbatch_size == ids.shape[0] // 2


class _NoExample(ToyModule):
    """Fitted with a plain DataLoader: no datamodule, no example_input_array."""

    def __init__(self, optimizer: Any = torch.optim.Adam, **options: Any) -> None:
        super().__init__()
        self.optimizer_class, self.options = optimizer, options

    def configure_optimizers(self) -> Any:
        return self.optimizer_class(self.parameters(), lr=0.05, **self.options)


def _planned(module: ToyModule, **settings: Any) -> PipelineStrategy:
    strategy = PipelineStrategy(stages=2, chunks=2, checkpoint="auto", memory_budget="1GiB", **settings)
    quiet_trainer(strategy, max_steps=1).fit(module, toy_loader())
    return strategy


def test_a_fit_given_only_a_train_loader_plans_on_its_first_batch() -> None:
    strategy = _planned(_NoExample())
    assert strategy.auto_plan is not None
    assert strategy.auto_plan.profiles[2].microbatch_size == 8  # the loader's batch of 16, in 2


def _optimizer_bytes(strategy: PipelineStrategy) -> List[int]:
    return [s.optimizer for s in strategy.auto_plan.choice.prediction.stages]


def _param_bytes(strategy: PipelineStrategy) -> List[int]:
    return [s.params for s in strategy.auto_plan.choice.prediction.stages]


def test_the_plan_counts_no_state_for_the_sgd_configure_optimizers_returns() -> None:
    strategy = _planned(_NoExample(torch.optim.SGD))
    assert _optimizer_bytes(strategy) == [0, 0]


def test_the_plan_counts_one_buffer_per_parameter_for_sgd_with_momentum() -> None:
    strategy = _planned(_NoExample(torch.optim.SGD, momentum=0.9))
    assert _optimizer_bytes(strategy) == _param_bytes(strategy)


def test_memory_optimizer_overrides_the_optimizer_configure_optimizers_returns() -> None:
    strategy = _planned(_NoExample(torch.optim.SGD), memory_optimizer="momentum")
    assert _optimizer_bytes(strategy) == _param_bytes(strategy)


@pytest.mark.parametrize(
    "make, counted",
    [
        (lambda p: torch.optim.SGD(p, lr=0.1), "sgd"),
        (lambda p: {"optimizer": torch.optim.AdamW(p)}, "adamw"),
        (lambda p: ([torch.optim.SGD(p, lr=0.1, momentum=0.9)], []), "momentum"),
        (lambda p: [torch.optim.SGD(p, lr=0.1), torch.optim.Adam(p)], "adam"),  # the most state
    ],
)
def test_fitted_optimizer_reads_every_form_configure_optimizers_returns(make, counted) -> None:
    module = ToyModule()
    module.configure_optimizers = lambda: make(list(module.parameters()))  # type: ignore[method-assign]
    found = fitted_optimizer(module)
    name = type(found).__name__.lower()
    if name == "sgd" and found.param_groups[0]["momentum"]:
        name = "momentum"
    assert name == counted


def test_an_optimizer_the_memory_model_does_not_know_is_a_configuration_error() -> None:
    module = ToyModule()
    module.configure_optimizers = lambda: torch.optim.RMSprop(module.parameters())  # type: ignore[method-assign]
    with pytest.raises(
        PipeckptConfigError, match=r"RMSprop from configure_optimizers.*HINT: set memory_optimizer"
    ):
        fitted_optimizer(module)
