"""The app's settings checked against the schema's ranges and each other before anything is built
(issue 37, item 6): each refusal is a :class:`~pipeckpt.PipeckptConfigError` naming the setting as
typed on the command line, and train.py turns it into one line and exit status 1."""

import os
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from support import forkserver
from support.config_options import MODEL_OF_DATA, SETTINGS_OF_DATA, SETTINGS_OF_MODEL

from pipeckpt import PipeckptConfigError
from pipeckpt.app.checks import Range, check_config, check_overrides
from pipeckpt.app.config import register

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"
GROUPS = ["model", "data", "strategy", "ckpt", "trainer", "experiment"]


def compose_train(tmp_path: Path, *overrides: str):
    register()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("train", overrides=[f"output_dir={tmp_path}", *overrides])


def refusal(tmp_path: Path, *overrides: str) -> str:
    """The message check_config refuses the composed overrides with (one ``HINT``)."""
    with pytest.raises(PipeckptConfigError) as error:
        check_config(compose_train(tmp_path, *overrides))
    message = str(error.value)
    assert message.count(". HINT: ") == 1, message
    return message


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in options(g)], ids=str)
def test_every_config_in_conf_passes_the_checks(tmp_path, group, option):
    overrides = [f"{group}={option}"]
    if group == "data":
        overrides += [f"model={MODEL_OF_DATA[option]}", *SETTINGS_OF_DATA.get(option, [])]
    if group == "model":  # model=custom names a module of the user's own and the data's length
        overrides += SETTINGS_OF_MODEL.get(option, [])
    check_config(compose_train(tmp_path, *overrides))


def test_a_zero_sequence_length_is_refused_naming_data_seq_len(tmp_path):
    assert refusal(tmp_path, "data.seq_len=0").startswith("data.seq_len=0: must be >= 1")


def test_a_zero_batch_size_is_refused_naming_data_batch_size(tmp_path):
    assert refusal(tmp_path, "data.batch_size=0").startswith("data.batch_size=0: must be >= 1")


def test_data_seq_len_unlike_model_seq_len_is_refused_naming_both_and_the_fix(tmp_path):
    message = refusal(tmp_path, "data.seq_len=64")
    assert message.startswith("data.seq_len=64 with model.seq_len=128: ")
    assert "HINT: set model.seq_len=64" in message


def test_the_data_follows_a_changed_model_seq_len(tmp_path):
    check_config(compose_train(tmp_path, "model.seq_len=64"))


def test_synthetic_tokens_below_the_models_vocabulary_pass_and_above_it_are_refused(tmp_path):
    check_config(compose_train(tmp_path, "data=synthetic", "data.vocab_size=100"))
    message = refusal(tmp_path, "data=synthetic", "data.vocab_size=300")
    assert message.startswith("data.vocab_size=300 with model.vocab_size=256: ")


def test_zero_layers_is_refused_naming_model_n_layers(tmp_path):
    assert refusal(tmp_path, "model.n_layers=0").startswith("model.n_layers=0: must be >= 1")


@pytest.mark.parametrize(
    "override,rule",
    [
        ("model.dropout=1.0", "in [0, 1)"),
        ("model.lr=0.0", "> 0"),
        ("model.weight_decay=-0.1", ">= 0"),
        ("data.val_fraction=0.0", "in (0, 1)"),
        ("data.max_bytes=0", ">= 1"),
        ("data.num_workers=-1", ">= 0"),
        ("trainer.accumulate_grad_batches=0", ">= 1"),
        ("trainer.max_steps=-2", ">= -1"),
        ("trainer.limit_val_batches=1.5", ">= 0, or a fraction in [0.0, 1.0]"),
        ("trainer.val_check_interval=0", ">= 1, or a fraction"),
        ("trainer.num_nodes=0", ">= 1"),
        ("seed=-1", "in [0, 4294967295]"),
        ("threads=0", ">= 1"),
    ],
)
def test_a_numeric_setting_out_of_its_range_is_refused_naming_it_and_the_range(tmp_path, override, rule):
    message = refusal(tmp_path, override)
    assert message.startswith(f"{override}: must be {rule}"), message
    assert f"HINT: set {override.split('=')[0]} to a value {rule}" in message


@pytest.mark.parametrize(
    "overrides,named",
    [
        (["model=mlp", "model.depth=0"], "model.depth=0"),
        (["model=convnet", "data.image_size=1"], "data.image_size=1"),
        (["model=convnet", "data.noise=-1.0"], "data.noise=-1.0"),
        (["data=synthetic", "data.steps=0"], "data.steps=0"),
        (["model=llama3", "model.seq_len=0"], "model.seq_len=0"),
    ],
)
def test_the_other_models_and_data_have_their_ranges_too(tmp_path, overrides, named):
    assert refusal(tmp_path, *overrides).startswith(f"{named}: must be ")


def test_a_memory_budget_that_is_not_a_size_is_refused_naming_it_and_the_forms(tmp_path):
    message = refusal(tmp_path, "ckpt=auto", "memory.budget=abc")
    assert message.startswith("memory.budget='abc': is not a size"), message
    assert "GiB" in message and "e.g. 12GiB or 800MB" in message


def test_heads_that_do_not_divide_the_width_are_refused_naming_both(tmp_path):
    message = refusal(tmp_path, "model.d_model=100", "model.n_heads=3")
    assert message.startswith("model.d_model=100 with model.n_heads=3: ")


def test_an_unknown_gpt_size_is_refused_listing_the_sizes(tmp_path):
    assert "['mini', 'small', 'tiny']" in refusal(tmp_path, "model.size=huge")


def test_tensor_parallel_that_does_not_divide_the_world_is_refused_naming_the_world(tmp_path):
    message = refusal(
        tmp_path, "strategy.engine=distributed", "strategy.tensor_parallel=3", "trainer.devices=2"
    )
    assert message.startswith("strategy.tensor_parallel=3 on trainer.devices=2 x trainer.num_nodes=1 = 2")
    assert "tensor_parallel_plan" not in message and "one of [1, 2]" in message


def test_dp_times_tensor_parallel_beyond_the_world_is_refused_naming_dp(tmp_path):
    overrides = ["strategy.engine=distributed", "strategy.tensor_parallel=2", "strategy.dp=3"]
    message = refusal(tmp_path, *overrides, "trainer.devices=4")
    assert message.startswith("strategy.dp=3 with strategy.tensor_parallel=2 on trainer.devices=4")


def test_stages_times_tensor_parallel_beyond_the_world_is_refused_naming_stages(tmp_path):
    overrides = ["strategy.engine=distributed", "strategy.tensor_parallel=2", "strategy.stages=3"]
    assert refusal(tmp_path, *overrides, "trainer.devices=4").startswith("strategy.stages=3 (pp=3)")


def test_an_unknown_schedule_is_refused_under_the_local_engine_listing_the_schedules(tmp_path):
    message = refusal(tmp_path, "strategy.schedule=nonsense")
    assert message.startswith("strategy.schedule='nonsense': must name a schedule")
    assert "GPipe" in message and "1F1B" in message and "engine" not in message


def test_an_unknown_schedule_is_refused_under_the_distributed_engine_too(tmp_path):
    message = refusal(tmp_path, "strategy.engine=distributed", "strategy.schedule=nonsense")
    assert message.startswith("strategy.schedule='nonsense'")


def test_a_non_ascii_override_value_is_refused_with_a_hint_to_quote_it():
    with pytest.raises(PipeckptConfigError) as error:
        check_overrides(["trainer=fast", "data.path=/tmp/données"])
    message = str(error.value)
    assert message.startswith("data.path=/tmp/données: ") and "'é'" in message
    assert "HINT: quote the value" in message and "\"data.path='/tmp/données'\"" in message


def test_quoted_non_ascii_values_and_flags_pass():
    check_overrides(["data.path='/tmp/données'", "-m", "--config-name=train", "seed=1"])


@pytest.mark.parametrize(
    "span,inside,outside",
    [
        (Range(low=1), [1, 10**20], [0, -1, 0.5, True, "1", float("nan")]),
        (Range(low=0, high=1, high_open=True), [0, 0.0, 0.99], [1, 1.0, -0.1]),
        (Range(low=0, or_fraction=True), [0, 7, 0.0, 1.0], [-1, 1.5]),
    ],
)
def test_a_range_holds_its_values_and_no_other(span, inside, outside):
    assert all(span.holds(v) for v in inside) and not any(span.holds(v) for v in outside)


def test_the_plan_command_runs_the_same_checks():
    from pipeckpt.plan import run

    with pytest.raises(PipeckptConfigError, match=r"^data\.seq_len=0: must be >= 1"):
        run(["data.seq_len=0"])


def run_train(tmp_path: Path, *overrides: str):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    command = [sys.executable, "train.py", "trainer=fast", f"hydra.run.dir={tmp_path}", *overrides]
    return forkserver.run(command, cwd=ROOT, env=env, timeout=300)


def test_train_py_refuses_a_zero_sequence_length_with_exit_1_and_no_traceback(tmp_path):
    done = run_train(tmp_path, "data.seq_len=0")
    assert done.returncode == 1, done.stderr[-2000:]
    assert "Traceback" not in done.stderr + done.stdout
    assert "Configuration error: data.seq_len=0: must be >= 1" in done.stderr


def test_train_py_hints_to_quote_a_non_ascii_path_with_exit_1_and_no_traceback(tmp_path):
    done = run_train(tmp_path, "data.path=/tmp/données")
    assert done.returncode == 1, done.stderr[-2000:]
    assert "Traceback" not in done.stderr + done.stdout
    assert "HINT: quote the value" in done.stderr


def test_train_py_refuses_a_memory_budget_that_is_not_a_size_with_exit_1_and_no_traceback(tmp_path):
    done = run_train(tmp_path, "ckpt=auto", "memory.budget=abc")
    assert done.returncode == 1, done.stderr[-2000:]
    assert "Traceback" not in done.stderr + done.stdout
    assert "Configuration error: memory.budget='abc': is not a size" in done.stderr
