"""One rank of a fault-injection run, started by test_errors_first.py beside it (see tests/support/ranks.py).

The spec's run names a phase (``setup``, ``load`` or ``step``) and a rank: that rank raises a
ValueError there (in the module's ``setup`` hook, its ``on_load_checkpoint`` hook, or a layer's
forward of step 1), printing the moment first; every other rank goes on until the failure reaches it.
"""

import time
from typing import Any, Dict

from distributed_worker import die_mid_step
from support.ranks import quiet_trainer, serve
from support.toy import ToyModule, toy_loader

from pipeckpt import PipelineStrategy


class Faulty(ToyModule):
    def __init__(self, phase: str, rank: int) -> None:
        super().__init__()
        self.phase, self.faulty_rank = phase, rank

    def _maybe_raise(self, phase: str) -> None:
        if phase == self.phase and self.trainer.global_rank == self.faulty_rank:
            print(f"worker: rank {self.faulty_rank} raises at time={time.time():.3f}", flush=True)
            raise ValueError(f"injected at {phase} on rank {self.faulty_rank}")

    def setup(self, stage: str) -> None:
        self._maybe_raise("setup")

    def on_load_checkpoint(self, checkpoint: Dict[str, Any]) -> None:
        self._maybe_raise("load")


def run(spec: Dict[str, Any], out: str, world: int) -> None:
    module = Faulty(spec["phase"], spec["rank"])
    if spec["phase"] == "step":
        die_mid_step(module, step=1, microbatch=1, raises=True)
    strategy = PipelineStrategy(engine="distributed", balance=[3, 3], chunks=2, timeout=spec["timeout"])
    trainer = quiet_trainer(strategy, world, max_steps=3)
    trainer.fit(module, toy_loader(), ckpt_path=spec.get("resume"))


if __name__ == "__main__":
    serve(run)
