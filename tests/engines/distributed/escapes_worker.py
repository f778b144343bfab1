"""One process of tests/engines/distributed/test_escapes_distributed.py: a model whose layer on the first
stage hands a tensor out other than through its return value, trained under the distributed engine.

Started by tests/support/ranks.py with LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set::

    python tests/engines/distributed/escapes_worker.py SPEC.json

The spec's one run names the model ("sequential": a layer that appends its activation to a list the
loss reads; "hooked": a forward hook on a pipeline_of layer that stores its output; "restored": a hook
that keeps the very tensor the first stage returns, all from tests/support/side_channels.py) and the
strategy's settings; the run is expected to stop at the first step, so the test reads the ranks' logs.
"""

from typing import Any, Dict

from support.ranks import quiet_trainer, serve
from support.side_channels import HookedBlocks, ReStoring, SideChannel, loader

from pipeckpt import PipelineStrategy


def run(spec: Dict[str, Any], out: str, world: int) -> None:
    models = {"sequential": lambda: SideChannel(at=0), "hooked": HookedBlocks, "restored": ReStoring}
    module = models[spec["model"]]()
    strategy = PipelineStrategy(engine="distributed", **spec["strategy"])
    quiet_trainer(strategy, world, max_steps=2).fit(module, loader())
    print("worker: trained", flush=True)


if __name__ == "__main__":
    serve(run)
