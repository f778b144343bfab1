"""``PipelineStrategy(layout="auto", cluster=...)`` in a user's own script, no configs: the layout
searched at ``trainer.fit`` for the module and its first batch, trained by every process Lightning
starts, with the numbers of one device (``tests/support/auto_script.py``: HF GPT-2 behind a user's
glue, without dropout). The loader's batch is the global one: each replica trains its share.
Every refusal names the user's value before any work."""

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List, Sequence

import lightning as L
import pytest
import torch
import yaml
from support import forkserver
from support.user_modules import UserGPT2, UserTokens

from pipeckpt import PipeckptConfigError, PipelineStrategy
from pipeckpt._rng import forked_random_states
from pipeckpt.plan_given import script_config
from pipeckpt.plan_pick import PICK_VARIABLE
from pipeckpt.strategy_layout import LayoutSearch, replica_share

SCRIPT = Path(__file__).resolve().parents[1] / "support" / "auto_script.py"
ROOT = SCRIPT.parents[2]


def _script(tmp_path: Path, name: str, *args: str, launcher: Sequence[str] = ()) -> Dict[str, Any]:
    """The script's result (rank 0's JSON), run as a user's shell runs it (``launcher``: the Python
    module that starts it, torchrun's)."""
    out = tmp_path / f"{name}.json"
    env = {k: v for k, v in os.environ.items() if k != PICK_VARIABLE}
    env.update(PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore")
    done = forkserver.run(
        [sys.executable, *launcher, str(SCRIPT), "--out", str(out), *args], cwd=tmp_path, env=env, timeout=900
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result: Dict[str, Any] = json.loads(out.read_text())
    result["stdout"] = done.stdout + done.stderr
    return result


@pytest.fixture(scope="module")
def one_device(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Any]:
    return _script(tmp_path_factory.mktemp("one"), "one")


@pytest.mark.parametrize(
    "pinned, kept",
    [(["dp=2"], {"dp": 2, "stages": 1}), (["stages=2"], {"dp": 1, "stages": 2})],
    ids=["two-replicas", "two-stages"],
)
def test_a_scripts_searched_layout_trains_as_one_device_does(
    tmp_path: Path, one_device: Dict[str, Any], pinned: List[str], kept: Dict[str, int]
) -> None:
    """Two steps and a validation: the same val_loss as Lightning's one-device run, to float
    tolerance (1e-5 relative: the replicas' gradients are averaged, the stages' sent in float32),
    with the setting the script named kept by the search."""
    sets = [a for p in pinned for a in ("--set", p)]
    searched = _script(tmp_path, "auto", "--auto", "--cluster", "h100_8", *sets)
    assert {k: searched["pick"][k] for k in kept} == kept
    assert searched["val_loss"] == pytest.approx(one_device["val_loss"], rel=1e-5)
    assert "PipelineStrategy(layout='auto'): training with 1 " in searched["stdout"]
    assert "the pick by hand, without a search: PipelineStrategy(engine='distributed'" in searched["stdout"]
    (hparams,) = tmp_path.glob("logs/version_*/hparams.yaml")  # the pick among the run's hyperparameters
    logged = yaml.safe_load(hparams.read_text())
    assert logged["layout_settings"] == searched["pick"] and logged["layout"]["predicted_step_s"] > 0


@pytest.mark.slow
def test_a_scripts_search_on_this_machine_times_the_users_module(
    tmp_path: Path, one_device: Dict[str, Any]
) -> None:
    """``cluster="local"``: the search times the user's module here, in processes of its own that
    build it from its class and kept arguments (a step that calls the model's submodule, not the
    module's own forward, under FSDP included), and the pick trains."""
    searched = _script(tmp_path, "local", "--auto", "--cluster", "local")
    assert "times from one micro-batch timed layer by layer on this machine" in searched["stdout"]
    assert searched["val_loss"] == pytest.approx(one_device["val_loss"], rel=1e-5)


@pytest.mark.slow
def test_under_torchrun_every_rank_trains_rank_zeros_pick(tmp_path: Path, one_device: Dict[str, Any]) -> None:
    """Every process runs the script (torchrun): global rank 0 searches alone and hands its pick on
    through the run's store; the run trains it with one device's numbers."""
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    searched = _script(tmp_path, "torchrun", "--auto", "--set", "dp=2", launcher=torchrun)
    assert searched["pick"]["dp"] == 2
    assert searched["val_loss"] == pytest.approx(one_device["val_loss"], rel=1e-5)


def test_layout_auto_on_the_local_engine_is_refused_naming_the_engine() -> None:
    with pytest.raises(
        PipeckptConfigError, match=r"^layout='auto' with engine='local': .* add engine='distributed'"
    ):
        PipelineStrategy(layout="auto", cluster="local")


def test_a_cluster_that_is_no_preset_is_refused_at_fit_before_any_process_starts() -> None:
    strategy = PipelineStrategy(engine="distributed", layout="auto", cluster="h100_9")
    trainer = L.Trainer(strategy=strategy, devices=2, accelerator="cpu", logger=False, max_steps=1)
    with pytest.raises(PipeckptConfigError, match=r"^cluster='h100_9': .*h100_8x8"):
        trainer.fit(UserGPT2(layers=2), datamodule=UserTokens())
    assert getattr(trainer.strategy.launcher, "procs", []) == []  # no rank was started


def test_validating_before_any_fit_is_refused_as_the_search_needs_a_training_batch() -> None:
    strategy = PipelineStrategy(engine="distributed", layout="auto", cluster="h100_8")
    trainer = L.Trainer(strategy=strategy, devices=2, accelerator="cpu", logger=False)
    with pytest.raises(
        PipeckptConfigError, match=r"^PipelineStrategy\(layout='auto'\) before a fit: .*trainer.fit"
    ):
        trainer.validate(UserGPT2(layers=2), datamodule=UserTokens())


def test_a_cluster_with_a_manual_layout_is_refused_as_unused() -> None:
    with pytest.raises(PipeckptConfigError, match=r"^cluster='h100_8' with layout='manual': .*drop cluster"):
        PipelineStrategy(engine="distributed", cluster="h100_8")


def test_a_mode_per_stage_under_auto_is_refused_as_the_stage_count_is_searched() -> None:
    with pytest.raises(PipeckptConfigError, match=r"^checkpoint=\['always', 'never'\] with layout='auto'"):
        PipelineStrategy(
            engine="distributed", layout="auto", cluster="h100_8", checkpoint=["always", "never"]
        )


def test_a_memory_budget_under_auto_is_refused_naming_the_clusters_device_memory() -> None:
    with pytest.raises(
        PipeckptConfigError, match=r"^memory_budget='1GiB' with layout='auto': .*memory_bytes"
    ):
        PipelineStrategy(
            engine="distributed", layout="auto", cluster="h100_8", checkpoint="auto", memory_budget="1GiB"
        )


def test_a_mode_named_is_kept_on_every_stage_and_auto_is_the_searchs_to_choose() -> None:
    kept = PipelineStrategy(engine="distributed", layout="auto", cluster="h100_8", checkpoint="always")
    chosen = PipelineStrategy(engine="distributed", layout="auto", cluster="h100_8", checkpoint="auto")
    assert kept.layout_search.modes() == "always"
    assert chosen.layout_search.modes() is None and LayoutSearch({}, "h100_8").modes() is None


class _Unkept(L.LightningModule):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(width, width)


class _Kept(_Unkept):
    def __init__(self, width: int = 8, config: Any = None) -> None:
        super().__init__(width)
        self.save_hyperparameters()


TOKENS = (torch.zeros(8, 32, dtype=torch.long), torch.zeros(8, 32, dtype=torch.long))
WHERE = dict(
    settings={"engine": "distributed"}, cluster="h100_8", devices=2, num_nodes=1, precision="32-true"
)


def test_a_module_that_kept_no_arguments_is_refused_naming_save_hyperparameters(tmp_path: Path) -> None:
    with pytest.raises(
        PipeckptConfigError, match=r"_Unkept, whose arguments \['width'\] .*save_hyperparameters"
    ):
        script_config(_Unkept(16), TOKENS, tmp_path, **WHERE)


def test_a_kept_argument_that_is_no_plain_value_is_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(PipeckptConfigError, match=r"_Kept's kept arguments \['config', 'width'\].*ignore="):
        script_config(_Kept(8, config=torch.device("cpu")), TOKENS, tmp_path, **WHERE)


def test_the_search_reads_the_global_batch_and_tokens_from_the_first_batch(tmp_path: Path) -> None:
    cfg = script_config(UserGPT2(layers=2), TOKENS, tmp_path, **WHERE)
    assert (cfg.data.batch_size, cfg.data.seq_len, cfg.model.layers) == (8, 32, 2)
    assert cfg.model._target_ == "support.user_modules.UserGPT2"
    assert torch.equal(torch.load(cfg.data.path, weights_only=True)[0], TOKENS[0])


def test_a_batch_of_no_tokens_is_refused_naming_its_shapes(tmp_path: Path) -> None:
    with pytest.raises(PipeckptConfigError, match=r"a first training batch of shapes \[\[8, 4\]\]"):
        script_config(_Kept(), torch.zeros(8, 4), tmp_path, **WHERE)


def _replicas(dp: int, rank: int) -> Any:
    topology = SimpleNamespace(dp=dp, replica_of=lambda r: r % dp)
    search = SimpleNamespace(pick={"dp": dp})
    return SimpleNamespace(layout_search=search, engine=SimpleNamespace(topology=topology), global_rank=rank)


def test_each_replica_trains_its_equal_share_of_the_loaders_batch() -> None:
    batch = (torch.arange(8), {"ids": torch.arange(8) * 10})
    (share,) = replica_share(_replicas(2, 1), "training_step", (batch,))
    assert torch.equal(share[0], torch.arange(4, 8)) and torch.equal(share[1]["ids"], torch.arange(4, 8) * 10)
    assert replica_share(_replicas(2, 1), "validation_step", (batch,))[0] is batch  # evaluated whole


def test_a_batch_the_replicas_cannot_share_equally_is_refused_naming_drop_last() -> None:
    with pytest.raises(
        PipeckptConfigError, match=r"^a training batch of 7 samples .* 2 replicas.*drop_last=True"
    ):
        replica_share(_replicas(2, 0), "training_step", (torch.arange(7),))


def test_the_search_leaves_every_random_generator_as_it_found_it() -> None:
    torch.manual_seed(3)
    expected = torch.rand(2)
    torch.manual_seed(3)
    with forked_random_states():
        torch.rand(5)
    assert torch.equal(torch.rand(2), expected)
