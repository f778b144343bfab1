"""Minimal examples of the mistakes the config fuzzers found (tests/app/test_config_fuzz_*.py): each
setting now fails with one clean :class:`~pipeckpt.PipeckptConfigError` before any step, or trains.

A bug a fuzzer finds is kept here as a minimal ``xfail(strict=True)`` example, its input in
:data:`support.config_fuzz.AWAITING_FIX` (which the fuzzers skip) until the fix lands: then flip
the xfail and drop the entry.
"""

import math
import warnings
from datetime import timedelta

import pytest
from support.config_fuzz import CountingToy
from support.toy import fit

from pipeckpt import PipeckptConfigError, PipeckptWarning, PipelineStrategy


def test_an_unhashable_engine_is_a_config_error():
    with pytest.raises(PipeckptConfigError, match=r"engine=\['local'\]"):
        PipelineStrategy(engine=["local"])


@pytest.mark.parametrize("name", ["deferred_batch_norm", "pin_memory"])
def test_a_non_bool_switch_is_a_config_error(name):
    with pytest.raises(PipeckptConfigError, match=f"{name}='no'"):
        PipelineStrategy(**{name: "no"})


@pytest.mark.parametrize("timeout", [math.inf, 1e300])
def test_an_infinite_timeout_is_a_config_error(timeout):
    with pytest.raises(OverflowError):  # what the engine's process group set-up would do with it
        timedelta(seconds=timeout)
    with pytest.raises(PipeckptConfigError, match="timeout="):
        PipelineStrategy(engine="distributed", timeout=timeout)


def test_chunks_beyond_int64_fail_cleanly_or_train():
    # Any integer chunks >= 1 is documented valid: a batch too small makes fewer micro-batches (a warning).
    module = CountingToy(depth=3)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", PipeckptWarning)
        trainer = fit(module, PipelineStrategy(chunks=2**63), steps=1)
    assert (trainer.global_step, module.steps) == (1, 1)
    assert any("fewer micro-batches" in str(w.message) for w in seen)
