"""The ``compile`` setting: each pipelined layer's forward compiled in place, checkpoint modes exact.

Run under the ``aot_eager`` backend: it goes through Dynamo and AOTAutograd as inductor does
but generates no code, so the tests need no C++ compiler and take seconds, and its random ops
draw from torch's generator, which a recompute replays (see pipeckpt/checkpointing/compiling.py for what
holds under inductor)."""

from typing import Any, Dict, List

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from support.toy import ToyModule, assert_bitwise_equal, fit, params
from torch._dynamo.utils import counters

from pipeckpt import PipelineStrategy


def pipe(**kwargs: Any) -> PipelineStrategy:
    return PipelineStrategy(balance=[3, 3], chunks=2, compile="aot_eager", **kwargs)


class RecordForwards(Callback):
    """Which layers carry an instance ``forward`` (the compiled one) while training."""

    def __init__(self) -> None:
        self.compiled: List[bool] = []

    def on_train_batch_end(self, trainer: L.Trainer, module: Any, *args: Any) -> None:
        self.compiled = ["forward" in layer.__dict__ for layer in module.layers]


def test_every_checkpoint_mode_trains_bitwise_equal_with_dropout_under_compile() -> None:
    counters.clear()
    runs: Dict[str, Dict[str, torch.Tensor]] = {}
    for mode in ("never", "except_last", "always"):
        module = ToyModule(dropout=0.3)
        runs[mode] = params(fit(module, pipe(checkpoint=mode), steps=3).lightning_module)
    assert counters["frames"]["ok"] > 0  # Dynamo did compile the layers
    assert_bitwise_equal(runs["never"], runs["except_last"])
    assert_bitwise_equal(runs["never"], runs["always"])


def test_compile_keeps_state_dict_keys_and_teardown_gives_layers_their_own_forward() -> None:
    keys = list(ToyModule().state_dict())
    record = RecordForwards()
    module = ToyModule()
    fit(module, pipe(checkpoint="always"), steps=1, callbacks=[record])
    assert record.compiled == [True] * len(module.layers)
    assert list(module.state_dict()) == keys
    assert not any("forward" in layer.__dict__ for layer in module.layers)
