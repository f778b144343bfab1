"""``model=custom``: a user's own LightningModule, named by its import path, searched and trained by the
configs as the bundled models are (tests/support/user_modules.py: HF GPT-2 behind a user's glue). The
search reads its tokens per sample from ``data.seq_len``, the module taking none; a missing path or
length is refused naming it, before any work."""

from pathlib import Path

import pytest
import yaml
from support.layout_configs import train_py

from pipeckpt import PipeckptConfigError
from pipeckpt.plan import run
from pipeckpt.plan_layout import Answer

MINE = [
    "model=custom",
    "model._target_=support.user_modules.UserGPT2",
    "data.seq_len=32",
    "data.batch_size=8",
]
AUTO = ["strategy.engine=distributed", "trainer.devices=2", "strategy.layout=auto", "cluster=h100_8"]


def test_the_search_ranks_layouts_of_a_users_own_module_priced_at_the_datas_length(tmp_path: Path) -> None:
    answer, _, _ = run([*MINE, *AUTO, f"memory.png={tmp_path / 'frontier.png'}"])
    assert isinstance(answer, Answer) and len(answer.searched.ranked) >= 3
    for r in answer.searched.ranked:  # tokens a step: 8 samples of data.seq_len=32
        tokens = r.estimate.tokens_per_s_per_device * r.estimate.step_s * r.candidate.world
        assert tokens == pytest.approx(8 * 32, rel=1e-9)


def test_model_custom_without_its_import_path_is_refused_naming_the_setting() -> None:
    with pytest.raises(PipeckptConfigError, match=r"^model=custom without model._target_: .* import path"):
        run(["model=custom", "data.seq_len=32", *AUTO])


def test_data_following_a_length_the_users_model_lacks_is_refused_naming_it() -> None:
    with pytest.raises(
        PipeckptConfigError, match=r"^data.seq_len \(it follows model.seq_len\).*set data.seq_len="
    ):
        run([*MINE[:2], *AUTO])


@pytest.mark.slow
def test_train_py_trains_a_users_own_module_with_the_searched_pick(tmp_path: Path) -> None:
    mine = [
        "model=custom",
        "model._target_=tests.support.user_modules.UserGPT2",
        *MINE[2:],
    ]  # as a user's import
    done = train_py([*mine, *AUTO], tmp_path / "run")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "strategy.layout=auto: training with " in done.stdout
    (hparams,) = (tmp_path / "run").glob("logs/version_*/hparams.yaml")  # the pick, logged
    assert yaml.safe_load(hparams.read_text())["layout"]["layout"].startswith("pp")


def test_a_users_own_data_module_feeds_the_search_its_batch_and_length(tmp_path: Path) -> None:
    data = [
        "data=custom",
        "data._target_=support.user_modules.UserTokens",
        "data.seq_len=16",
        "data.batch_size=8",
    ]
    answer, _, _ = run([*MINE[:2], *data, *AUTO, f"memory.png={tmp_path / 'frontier.png'}"])
    assert isinstance(answer, Answer) and answer.searched.ranked
    best = answer.searched.best
    assert (
        best.estimate.tokens_per_s_per_device * best.estimate.step_s * best.candidate.world
        == pytest.approx(8 * 16)
    )


def test_data_custom_without_its_import_path_is_refused_naming_the_setting() -> None:
    with pytest.raises(PipeckptConfigError, match=r"^data=custom without data._target_: data of your own"):
        run([*MINE[:2], "data=custom", *AUTO])
