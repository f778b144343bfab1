"""A StopIteration escaping a step under the distributed engine is this rank's own error, not the end
of its epoch: Lightning's loop would take it for the end of the data on this rank alone, and the
other ranks would wait for it until they time out."""

from typing import Any, Dict, Tuple

import pytest

from pipeckpt.engines.distributed.engine import DistributedEngine
from pipeckpt.settings import PipeSettings


def _stops(hook: str, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    return next(iter(()))


def test_a_stop_iteration_inside_the_step_is_raised_as_this_ranks_own_error():
    engine = DistributedEngine(PipeSettings(engine="distributed"))
    engine.step = _stops  # type: ignore[assignment]
    with pytest.raises(
        RuntimeError, match=r"(?s)training_step raised StopIteration on this rank.*HINT"
    ) as raised:
        engine.run("training_step", None, (), {})  # type: ignore[arg-type]
    assert isinstance(raised.value.__cause__, StopIteration)
