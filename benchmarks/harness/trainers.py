"""The Trainer options of a measured CPU run: the step and nothing else (no logger, checkpoints,
progress bar, summary, sanity or validation steps), and each rank's loader kept as the benchmark
built it (no distributed sampler), so runs compare like with like."""

from typing import Any, Dict

QUIET_CPU: Dict[str, Any] = dict(
    accelerator="cpu",
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    num_sanity_val_steps=0,
    limit_val_batches=0,
    use_distributed_sampler=False,
)
