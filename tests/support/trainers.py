"""The quiet Trainer every test builds: the run itself and nothing else (no logger, checkpoints,
progress bar, summary, sanity or validation steps), so a test's output is its own."""

from typing import Any, Dict

from harness.trainers import QUIET_CPU

# The benchmarks' quiet options, with Lightning's distributed sampler left on: the tests check the
# data order the user's loader gets under each engine.
QUIET: Dict[str, Any] = {k: v for k, v in QUIET_CPU.items() if k != "use_distributed_sampler"}


def quiet_trainer(strategy: Any = None, *, devices: int = 1, **options: Any) -> Any:
    """A CPU ``Trainer`` on ``devices`` under ``strategy`` (Lightning's default if None);
    ``options`` add to or replace :data:`QUIET`."""
    import lightning as L

    settings: Dict[str, Any] = dict(QUIET, devices=devices, **({"strategy": strategy} if strategy else {}))
    settings.update(options)
    return L.Trainer(**settings)
