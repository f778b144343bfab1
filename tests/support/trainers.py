"""The quiet Trainer every test builds: the run itself and nothing else (no logger, checkpoints,
progress bar, summary, sanity or validation steps), so a test's output is its own."""

from typing import Any, Dict

QUIET: Dict[str, Any] = dict(
    accelerator="cpu",
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    num_sanity_val_steps=0,
    limit_val_batches=0,
)


def quiet_trainer(strategy: Any = None, *, devices: int = 1, **options: Any) -> Any:
    """A CPU ``Trainer`` on ``devices`` under ``strategy`` (Lightning's default if None);
    ``options`` add to or replace :data:`QUIET`."""
    import lightning as L

    settings: Dict[str, Any] = dict(QUIET, devices=devices, **({"strategy": strategy} if strategy else {}))
    settings.update(options)
    return L.Trainer(**settings)
