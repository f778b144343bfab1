"""On ``cluster=local`` the search prices a layout from one micro-batch timed on this machine: the model
built on real tensors and run before any fake build is open (an open fake build swaps fake tensors in,
and a step run then times fake kernels), on the threads a training process takes."""

import contextlib
from pathlib import Path
from typing import Any, List

import pytest
import torch
from support.local_cluster import FIGURES

from pipeckpt import plan_layout, plan_shapes
from pipeckpt.layout import calibrate, cost
from pipeckpt.plan import run

AUTO = ["model=gpt", "strategy.engine=distributed", "trainer.devices=2", "strategy.layout=auto"]


@pytest.fixture
def calibrated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(calibrate, "measured", lambda: dict(FIGURES))


def test_the_local_costs_are_a_real_step_timed_before_any_fake_build(
    calibrated: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    builds: List[bool] = []
    real_built = plan_shapes.built

    @contextlib.contextmanager
    def recording(*args: Any, fake: bool, **kwargs: Any) -> Any:
        builds.append(fake)
        with real_built(*args, fake=fake, **kwargs) as b:
            yield b

    profiles: List[Any] = []
    real_costs = cost.model_costs_from_profile

    def costs(profile: Any, **kwargs: Any) -> Any:
        profiles.append((profile, kwargs))
        return real_costs(profile, **kwargs)

    monkeypatch.setattr(plan_shapes, "built", recording)
    monkeypatch.setattr(cost, "model_costs_from_profile", costs)
    answer, _, _ = run([*AUTO, "cluster=local", f"memory.png={tmp_path / 'frontier.png'}"])
    assert builds[0] is False and all(builds[1:])  # the real build first, then only fake ones
    [(profile, kwargs)] = profiles
    assert profile.fake is False
    assert kwargs["flops_per_s"] == FIGURES["matmul_flops"]  # the one-thread rate it was timed at
    assert len(answer.searched.ranked) >= 3


def test_the_timed_step_runs_on_the_threads_of_a_training_process(
    calibrated: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hydra import compose, initialize_config_dir

    from pipeckpt.app.config import register
    from pipeckpt.plan import CONF

    seen: List[int] = []
    real_profiled = plan_shapes.SearchShapes._profiled

    def profiled(self: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("fake") is False:
            seen.append(torch.get_num_threads())
        return real_profiled(self, *args, **kwargs)

    monkeypatch.setattr(plan_shapes.SearchShapes, "_profiled", profiled)
    register()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[*AUTO, "cluster=local", "threads=1"])
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # the launching process's own threads, not a training process's
    try:
        plan_layout.search_config(cfg)
        assert seen == [1]
        assert torch.get_num_threads() == 2  # given back
    finally:
        torch.set_num_threads(before)
