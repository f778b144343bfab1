"""Config fuzzing, Hydra overrides (issue 11, item 6): random ``key=value`` overrides of train.py's
config, composed in-process and built as train.py builds them. Each is refused by Hydra at compose
time (a value its schema's type refuses, a key not in the schema), or fails at build with one clean
configuration error naming a broken setting (what train.py prints as "Configuration error: ..."),
or builds a Trainer whose strategy holds every setting as overridden.

How OmegaConf coerces each value for its schema type is part of the spec (:data:`OVERRIDES`); the
outcome of what reaches the strategy comes from the reference model in :mod:`support.config_fuzz`.
"""

import math
from pathlib import Path
from typing import Any, Dict, List, Tuple

import lightning as L
import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from hydra.utils import instantiate
from hypothesis import assume, event, given
from hypothesis import strategies as st
from support.config_fuzz import assert_names_one_of, awaiting_fix, fuzz, settings_problems, world_problems

import train
from pipeckpt.app.config import register

CONF = Path(__file__).resolve().parents[2] / "conf"

HYDRA = object()  # the schema's type refuses the value: Hydra's own error at compose time

# Per key: (override value, what the strategy receives, or HYDRA). How OmegaConf coerces each
# value for its schema type (int, Optional[List[int]], bool, Optional[float], Any) is part of the spec.
OVERRIDES: Dict[str, List[Tuple[str, Any]]] = {
    "strategy.stages": [
        ("null", None),
        ("1", 1),
        ("3", 3),
        ("0", 0),
        ("-1", -1),
        ("2.5", HYDRA),
        ("two", HYDRA),
    ],
    "strategy.balance": [
        ("null", None),
        ("[1,1]", [1, 1]),
        ("[2,1,1]", [2, 1, 1]),
        ("[]", []),
        ("[0,2]", [0, 2]),
        ("[1,x]", HYDRA),
        ("3", HYDRA),
    ],
    "strategy.balance_by": [("params", "params"), ("time", "time"), ("luck", "luck"), ("null", HYDRA)],
    "strategy.chunks": [
        ("1", 1),
        ("2", 2),
        ("8", 8),
        ("'3'", 3),
        ("0", 0),
        ("-3", -3),
        ("2.0", HYDRA),
        ("true", HYDRA),
        ("null", HYDRA),
    ],
    "ckpt.modes": [
        ("never", "never"),
        ("always", "always"),
        ("offload", "offload"),
        ("[always,never]", ["always", "never"]),
        ("[always]", ["always"]),
        ("sometimes", "sometimes"),
        ("[always,sometimes]", ["always", "sometimes"]),
        ("null", None),
        ("3", 3),
    ],
    "strategy.placement": [
        ("null", None),
        ("[0,0]", [0, 0]),
        ("[0]", [0]),
        ("[-1,0]", [-1, 0]),
        ("[a]", HYDRA),
    ],
    "strategy.deferred_batch_norm": [("true", True), ("false", False), ("abc", HYDRA)],
    "strategy.pin_memory": [("false", False), ("true", True), ("maybe", HYDRA)],
    "strategy.engine": [
        ("local", "local"),
        ("distributed", "distributed"),
        ("remote", "remote"),
        ("5", "5"),
        ("null", HYDRA),
        ("[local]", HYDRA),
    ],
    "strategy.schedule": [
        ("null", None),
        ("gpipe", "gpipe"),
        ("1f1b", "1f1b"),
        ("interleaved_1f1b", "interleaved_1f1b"),
        ("zbv_zero_bubble", "zbv_zero_bubble"),
        ("zigzag", "zigzag"),
        ("[gpipe]", HYDRA),
    ],
    "strategy.dp": [("null", None), ("1", 1), ("2", 2), ("0", 0), ("1.5", HYDRA)],
    "strategy.virtual_stages": [("null", None), ("1", 1), ("2", 2), ("0", 0), ("x", HYDRA)],
    "strategy.timeout": [
        ("null", None),
        ("30", 30.0),
        ("0.5", 0.5),
        ("0", 0.0),
        ("-1", -1.0),
        ("nan", math.nan),
        ("soon", HYDRA),
    ],
    "trainer.devices": [("1", 1), ("2", 2), ("4", 4)],
    "strategy.chunk": [("4", HYDRA)],  # a misspelt key: not in the schema
    "+strategy.chunk": [("4", 4)],  # added past the schema: the strategy refuses it
}
# What conf/strategy/pipe.yaml and conf/ckpt/except_last.yaml give the strategy.
PIPE_YAML = {"stages": 2, "chunks": 4, "checkpoint": "except_last", "pin_memory": True}


@st.composite
def override_cases(draw: Any) -> List[Tuple[str, str, Any]]:
    keys = draw(st.lists(st.sampled_from(list(OVERRIDES)), unique=True, max_size=5))
    return [(key, *draw(st.sampled_from(OVERRIDES[key]))) for key in keys]


def build_like_train(cfg: Any) -> Dict[str, Any]:
    """What train.train() builds from a config, in its order, short of training."""
    data, model = instantiate(cfg.data), instantiate(cfg.model)
    strategy = instantiate(cfg.strategy, _convert_="all")
    callbacks = [instantiate(c) for c in (cfg.callbacks or {}).values()]
    logger = instantiate(cfg.logger) if cfg.logger else False
    trainer = instantiate(cfg.trainer, strategy=strategy, logger=logger, callbacks=callbacks)
    return {"data": data, "model": model, "strategy": strategy, "trainer": trainer}


@fuzz(examples=60)
@given(case=override_cases())
def test_hydra_overrides_fail_at_compose_or_cleanly_at_build_or_build(tmp_path, case):
    overrides = [f"{key}={text}" for key, text, _ in case]
    kw = dict(PIPE_YAML)
    kw.update({key.split(".")[-1].replace("modes", "checkpoint"): value for key, _, value in case})
    devices = kw.pop("devices", 1)  # trainer.devices: auto is one CPU
    assume(not awaiting_fix(kw))
    register()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        if any(value is HYDRA for _, _, value in case):
            event("refused by Hydra at compose")
            with pytest.raises(ConfigCompositionException):
                compose("train", overrides=[f"output_dir={tmp_path}", *overrides])
            return
        cfg = compose("train", overrides=[f"output_dir={tmp_path}", *overrides])
    early = settings_problems(kw)
    late = world_problems(kw, devices) if not early and kw.get("engine") == "distributed" else []
    if early or late:
        event("refused at build")
        with pytest.raises(Exception) as error:
            build_like_train(cfg)
        mistake = train._config_error(error.value)  # what train.py prints as "Configuration error: ..."
        assert mistake is not None, repr(error.value)
        assert_names_one_of(mistake, early or late)
        return
    event("built")
    objects = build_like_train(cfg)
    assert isinstance(objects["trainer"], L.Trainer)
    assert objects["trainer"].strategy is objects["strategy"]
    got = objects["strategy"].settings
    for name, value in kw.items():
        assert getattr(got, name) == value, name
