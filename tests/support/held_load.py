"""``model=hf`` whose pretrained weights are read only once the test says so: the signal point of the
tests of a SIGTERM while loading (tests/faults/test_sigterm_loading.py). Named on the command line
as ``model._target_=support.held_load.HFCausalLM``, so every rank, the ones Lightning launches too,
builds it; the folder ``$PIPECKPT_TEST_LOADING`` receives ``rank<LOCAL_RANK>`` (the rank's PID) as
the rank begins to read, and the read waits until the test writes ``go`` there (at most 5 minutes,
so that a rank the test forgot never hangs)."""

import os
import time
from pathlib import Path
from typing import Any, Callable, Dict

from torch import Tensor

from pipeckpt.app.models import hf
from pipeckpt.weights.pretrained import marked_in

FOLDER = "PIPECKPT_TEST_LOADING"
_HOLD_S = 300.0


class HFCausalLM(hf.HFCausalLM):
    def configure_model(self) -> None:
        first = self.model is None
        super().configure_model()
        if first and self.model is not None:
            for _, source in marked_in(self.model):
                source.read = _held(source.read)  # type: ignore[method-assign]


def _held(read: Callable[[Dict[str, Tensor]], Any]) -> Callable[[Dict[str, Tensor]], Any]:
    def read_when_told(wanted: Dict[str, Tensor]) -> Any:
        folder = Path(os.environ[FOLDER])
        rank = os.environ.get("LOCAL_RANK", "0")
        (folder / f"rank{rank}.partial").write_text(str(os.getpid()))
        os.replace(folder / f"rank{rank}.partial", folder / f"rank{rank}")
        deadline = time.monotonic() + _HOLD_S
        while not (folder / "go").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        return read(wanted)

    return read_when_told
