"""checkpoint='auto' with memory_budget: settings, the choice made by the strategy, the configs."""

from math import comb
from pathlib import Path

import lightning as L
import pytest
from hydra import compose, initialize_config_dir
from support.trainers import QUIET

from pipeckpt import PipelineStrategy
from pipeckpt._errors import PipeckptConfigError
from pipeckpt.app.config import register
from pipeckpt.app.data import SyntheticVectors
from pipeckpt.app.models import MLP
from pipeckpt.memory.auto import choose
from pipeckpt.memory.budget import balance_candidates, chunk_candidates, first_microbatch
from pipeckpt.memory.profile import profile
from pipeckpt.settings import PipeSettings

CONF = Path(__file__).resolve().parents[2] / "conf"


pytestmark = pytest.mark.usefixtures("one_thread")


def test_auto_without_a_budget_is_a_configuration_error() -> None:
    with pytest.raises(PipeckptConfigError, match=r"checkpoint='auto' without memory_budget.*HINT: set"):
        PipeSettings(checkpoint="auto")


def test_a_budget_with_modes_given_is_a_configuration_error() -> None:
    with pytest.raises(PipeckptConfigError, match="memory_budget='1GiB' with checkpoint='always'"):
        PipeSettings(checkpoint="always", memory_budget="1GiB")


@pytest.mark.parametrize("search", [["chunks"], ["modes", "layers"], "everything"])
def test_a_search_without_modes_or_with_an_unknown_item_is_a_configuration_error(search) -> None:
    with pytest.raises(PipeckptConfigError, match="memory_search="):
        PipeSettings(checkpoint="auto", memory_budget="1GiB", memory_search=search)


def test_an_unparseable_budget_fails_in_the_settings() -> None:
    with pytest.raises(PipeckptConfigError, match="memory_budget='20 gigs': is not a size"):
        PipeSettings(checkpoint="auto", memory_budget="20 gigs")


def test_chunk_candidates_cut_the_batch_evenly() -> None:
    assert chunk_candidates(12, 3) == [1, 2, 3, 4]
    assert chunk_candidates(8, 4) == [1, 2, 4, 8]


def test_balance_candidates_are_every_composition_when_few() -> None:
    got = balance_candidates(9, 3, (3, 3, 3))
    assert len(got) == len(set(got)) == comb(8, 2)
    assert all(sum(b) == 9 and min(b) >= 1 for b in got)


def test_balance_candidates_keep_near_the_default_when_many() -> None:
    got = balance_candidates(80, 8, (10,) * 8)
    assert got and all(sum(b) == 80 for b in got)
    assert all(abs(sum(b[: i + 1]) - 10 * (i + 1)) <= 2 for b in got for i in range(7))


def test_the_configs_pass_ckpt_auto_and_the_budget_to_the_strategy() -> None:
    register()
    overrides = ["ckpt=auto", "memory.budget=200MiB", "memory.search=[modes,chunks]"]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides)
    assert cfg.strategy.checkpoint == "auto"
    assert cfg.strategy.memory_budget == "200MiB"
    assert list(cfg.strategy.memory_search) == ["modes", "chunks"]
    assert cfg.strategy.memory_optimizer == "adamw"


def _fit(strategy: PipelineStrategy, *, batch_size: int = 16) -> tuple[L.Trainer, MLP, SyntheticVectors]:
    L.seed_everything(0)
    trainer = L.Trainer(
        strategy=strategy,
        devices=1,
        max_steps=2,
        **QUIET,
    )
    model = MLP(in_features=32, hidden=256, depth=4, num_classes=10, lr=0.01, weight_decay=0.0)
    data = SyntheticVectors(
        in_features=32, num_classes=10, num_samples=64, val_samples=16, batch_size=batch_size, seed=0
    )
    trainer.fit(model, data)
    return trainer, model, data


def _expected(model: MLP, data: SyntheticVectors, budget: int, chunks, balance=(4, 5)):
    """choose() on profiles of the datamodule's first batch, as the strategy should call it."""
    data.setup("fit")
    x, y = next(iter(data.train_dataloader()))
    options = [chunks] if isinstance(chunks, int) else chunks
    profiles = {
        c: profile(
            model.layers, first_microbatch(x, c), loss_fn=model.pipeline_loss, target=first_microbatch(y, c)
        )
        for c in options
    }
    return choose(profiles, budget, balance=balance, chunks=chunks, optimizer="adamw", shared_device=True)


def test_the_strategy_builds_the_plan_choose_picks_under_the_budget() -> None:
    budget = 8 * 2**20
    strategy = PipelineStrategy(
        stages=2, chunks=4, checkpoint="auto", memory_budget=budget, memory_optimizer="adamw"
    )
    trainer, _, _ = _fit(strategy)
    auto = strategy.auto_plan
    assert auto is not None and trainer.global_step == 2
    assert strategy.plan.modes == auto.choice.modes
    assert strategy.plan.balance == auto.choice.balance
    assert auto.choice.process_peak is not None and auto.choice.process_peak <= budget
    assert strategy.settings.checkpoint == [m.name for m in auto.choice.modes]
    assert auto.choice.balance == (4, 5)  # the params balance: only modes were searched


def test_the_plan_on_one_device_is_described_by_the_whole_devices_peak() -> None:
    budget = 8 * 2**20
    strategy = PipelineStrategy(
        stages=2, chunks=4, checkpoint="auto", memory_budget=budget, memory_optimizer="adamw"
    )
    _fit(strategy)
    auto = strategy.auto_plan
    whole = auto.choice.process_peak / 2**20
    assert f"predicted peak of the one device (all stages) {whole:.1f} MiB" in auto.describe()


def test_a_tight_budget_checkpoints_and_the_plan_fits_it() -> None:
    data = SyntheticVectors(
        in_features=32, num_classes=10, num_samples=64, val_samples=16, batch_size=16, seed=0
    )
    model = MLP(in_features=32, hidden=256, depth=4, num_classes=10, lr=0.01, weight_decay=0.0)
    never = _expected(model, data, 2**40, 4)  # an unlimited budget: never everywhere
    assert all(m.name == "never" for m in never.modes)
    # Both stages on the one CPU: the budget is the device's, held against the whole process's peak.
    budget = never.process_peak - 1
    strategy = PipelineStrategy(
        stages=2, chunks=4, checkpoint="auto", memory_budget=budget, memory_optimizer="adamw"
    )
    _fit(strategy)
    assert any(m.checkpoints for m in strategy.plan.modes)
    assert strategy.auto_plan.choice.process_peak <= budget


def test_chunks_in_the_search_may_change_the_micro_batch_count() -> None:
    strategy = PipelineStrategy(
        stages=2, chunks=4, checkpoint="auto", memory_budget="2GiB", memory_search=["modes", "chunks"]
    )
    _fit(strategy)
    # Everything fits: the fastest plan runs the fewest micro-batches' overheads or the best pipeline;
    # whichever it is, the engine runs the chosen count.
    assert strategy.settings.chunks == strategy.auto_plan.choice.chunks
    assert strategy.auto_plan.choice.chunks in chunk_candidates(16, 4)


def test_an_infeasible_budget_stops_before_the_first_step() -> None:
    strategy = PipelineStrategy(stages=2, chunks=4, checkpoint="auto", memory_budget="10KiB")
    with pytest.raises(PipeckptConfigError, match=r"smallest feasible budget is .* decided by stage \d"):
        _fit(strategy)
