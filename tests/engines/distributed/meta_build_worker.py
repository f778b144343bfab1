"""One rank of a meta-build run, started by test_meta_build.py beside it (see tests/support/ranks.py).

The spec's run names a build: ``eager`` (built in ``__init__``), ``configure_model``, ``init_module``
(``trainer.init_module(empty_init=True)``) or ``uninitialisable``. Each rank saves the tensors it
holds for real at fit start and after training to ``<run>_rank<r>.pt``, or the error it raised."""

from pathlib import Path
from typing import Any, Dict

import lightning as L
import torch
from support.meta_models import Configured, Uninitialisable, held
from support.ranks import quiet_trainer, serve
from support.toy import ToyModule, toy_loader

from pipeckpt import PipelineStrategy
from pipeckpt._errors import PipeckptConfigError

SEED, TRAINER_SEED = 5, 11  # the module's own seed, and the one Lightning re-seeds with at set-up


def _real(module: torch.nn.Module) -> Dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items() if not v.is_meta}


class Held(L.Callback):
    """What the module holds for real at fit start."""

    def __init__(self) -> None:
        self.at_start: Dict[str, torch.Tensor] = {}

    def on_fit_start(self, trainer: Any, module: Any) -> None:
        self.at_start = _real(module)


def run(spec: Dict[str, Any], out: str, world: int) -> None:
    L.seed_everything(TRAINER_SEED)
    build = spec["build"]
    strategy = PipelineStrategy(engine="distributed", balance=spec["balance"], chunks=2)
    at_start = Held()
    trainer = quiet_trainer(strategy, world, max_steps=3, callbacks=[at_start])
    when_built = -1  # elements held for real once built (an eager build: not recorded)
    if build == "init_module":
        with trainer.init_module(empty_init=True):
            module: ToyModule = ToyModule(seed=SEED, batch_norm=True)
        when_built = held(module)
    elif build == "eager":
        module = ToyModule(seed=SEED, batch_norm=True)
    else:
        module = (Configured if build == "configure_model" else Uninitialisable)(seed=SEED)
    try:
        trainer.fit(module, toy_loader())
        if isinstance(module, Configured):
            when_built = module.held_when_built
        result = dict(when_built=when_built, at_start=at_start.at_start, trained=_real(module))
    except PipeckptConfigError as error:
        result = dict(error=str(error), steps=module.global_step)
    torch.save(result, Path(out) / f"{spec['name']}_rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    serve(run)
