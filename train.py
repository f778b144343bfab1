"""Train a model with pipeline parallelism and per-stage activation checkpointing.

The configuration is composed by Hydra from conf/ (docs/SETTINGS.md, "The app's config groups");
each command-line override names a config option (``ckpt=always``) or a value
(``strategy.chunks=8``). Outputs go to outputs/<run>/: logs, checkpoints, and
the per-stage report (stage_report.png, stage_report.json).

One CPU (the default: tiny GPT on the standard library's sources, 2 stages, except_last):

    python train.py
    python train.py ckpt=always strategy.stages=4 strategy.chunks=8
    python train.py ckpt.modes=[always,except_last] trainer.precision=bf16-mixed
    python train.py -m ckpt=never,except_last,always       # one summary line per run
    python train.py strategy.engine=distributed trainer.devices=4 strategy.layout=auto cluster=local
    python train.py ckpt_path=outputs/<run>/checkpoints/last.ckpt trainer.max_steps=400

One host with several GPUs (one stage per GPU):

    python train.py model.size=small strategy.stages=null strategy.chunks=8 trainer.precision=bf16-mixed
    python train.py experiment=gpt_small_offload

SLURM (one process per GPU, the distributed engine):

    sbatch --nodes=2 --ntasks-per-node=4 --gpus-per-node=4 \\
        examples/slurm/pipe.sbatch experiment=gpt_small_offload
    python train.py -m hydra/launcher=slurm strategy.engine=distributed trainer.num_nodes=2 \\
        trainer.devices=4 hydra.launcher.tasks_per_node=4 hydra.launcher.gpus_per_node=4
"""

import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

import hydra
import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from pipeckpt import PipeckptCheckpointError, PipeckptConfigError, PipeckptSaveError
from pipeckpt.app.checks import check_config, check_overrides
from pipeckpt.app.config import register
from pipeckpt.app.sample import sample_after_training
from pipeckpt.app.throughput import ThroughputLog
from pipeckpt.export import HFExport
from pipeckpt.plan_pick import apply_layout
from pipeckpt.report.render import format_table
from pipeckpt.report.stage_report import StageReport
from pipeckpt.sizes import human
from pipeckpt.state.final_checkpoint import save_final
from pipeckpt.strategy_layout import log_pick

register()


def train(cfg: DictConfig) -> dict[str, Any]:
    """Builds everything from ``cfg``, trains, and returns the run's summary."""
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    # strategy.layout=auto: the searched layout, before anything is built (a mode named kept)
    cfg = apply_layout(cfg, overrides=_overrides())
    L.seed_everything(cfg.seed, workers=True)
    datamodule = instantiate(cfg.data)
    model = instantiate(cfg.model)
    strategy = instantiate(cfg.strategy, _convert_="all") if "_target_" in cfg.strategy else cfg.strategy.name
    callbacks = [instantiate(c) for c in (cfg.callbacks or {}).values()]
    this_run = _ThisRun()
    logger = instantiate(cfg.logger) if cfg.logger else False
    trainer: L.Trainer = instantiate(
        cfg.trainer, strategy=strategy, logger=logger, callbacks=[*callbacks, this_run]
    )
    say = print if trainer.is_global_zero else (lambda *args, **kwargs: None)
    if cfg.get("layout_pick"):  # strategy.layout=auto: the pick among the run's hyperparameters
        log_pick(trainer.loggers, OmegaConf.to_container(cfg.layout_pick))

    def validate(ckpt_path: Optional[str] = None) -> float:
        return trainer.validate(model, datamodule, ckpt_path=ckpt_path, verbose=False)[0]["val_loss"]

    # trainer.limit_val_batches=0 is Lightning's switch for no validation: it returns no results then
    validating = bool(cfg.validate) and trainer.limit_val_batches != 0
    summary: dict[str, Any] = {"output_dir": cfg.output_dir, "is_global_zero": trainer.is_global_zero}
    if validating:
        summary["val_loss_start"] = validate(cfg.ckpt_path)
        say(f"val_loss at start: {summary['val_loss_start']:.4f}", flush=True)
    trainer.fit(model, datamodule, ckpt_path=cfg.ckpt_path)
    summary["fit_s"] = time.perf_counter() - this_run.started
    summary["global_step"] = trainer.global_step
    summary["first_step"] = this_run.first_step
    if validating:
        # On the final weights, from the checkpoint holding them: with no path, Lightning would
        # validate a requeued SLURM job's preemption checkpoint instead.
        summary["val_loss_end"] = validate(_final_checkpoint(trainer, cfg.output_dir))
        say(f"val_loss at end:   {summary['val_loss_end']:.4f}", flush=True)
    if trainer.is_global_zero:  # no collective: the other ranks may leave
        export = next((c.dirpath for c in callbacks if isinstance(c, HFExport)), None)
        line = sample_after_training(
            trainer, model, datamodule, export_dir=export, output_dir=Path(cfg.output_dir)
        )
        if line is not None:
            print(line, flush=True)
    throughput = next((c for c in callbacks if isinstance(c, ThroughputLog)), None)
    summary["throughput"] = throughput.summary() if throughput is not None else {}
    report = next((c for c in callbacks if isinstance(c, StageReport)), None)
    if report is not None and report.stats:
        summary["stages"] = report.stats
        say(format_table(report.stats), flush=True)
    return summary


class _ThisRun(L.Callback):
    """Where and when this run's training started (a resumed run counts from its checkpoint's step)."""

    def __init__(self) -> None:
        self.first_step = 0
        self.started = time.perf_counter()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.first_step = trainer.global_step
        self.started = time.perf_counter()


def _final_checkpoint(trainer: L.Trainer, output_dir: str) -> str:
    """A checkpoint of the final weights: last.ckpt (pipeckpt.state.final_checkpoint keeps it at the final
    step), or one written now when no ModelCheckpoint keeps one."""
    written = save_final(trainer)
    callback = trainer.checkpoint_callback
    last = getattr(callback, "last_model_path", "") if callback is not None else ""
    if written or last:
        return written[0] if written else last
    path = os.path.join(output_dir, "final.ckpt")
    trainer.save_checkpoint(path, weights_only=False)  # the whole state; saying so silences Lightning's note
    return path


def _overrides() -> list[str]:
    """The command line's overrides (none where Hydra did not run this)."""
    try:
        return list(HydraConfig.get().overrides.task)
    except ValueError:  # not run by Hydra
        return []


def _summary_line(summary: dict[str, Any]) -> str:
    """One line per run, so that a multirun's jobs compare at a glance."""
    try:
        name = " ".join(HydraConfig.get().overrides.task) or "defaults"
    except ValueError:  # not run by Hydra
        name = "run"
    parts = [f"[{name}]"]
    if "val_loss_end" in summary:
        parts.append(f"val_loss {summary['val_loss_start']:.4f} -> {summary['val_loss_end']:.4f}")
    steps = summary["global_step"] - summary["first_step"]
    resumed = (
        f" (from step {summary['first_step']} to {summary['global_step']})" if summary["first_step"] else ""
    )
    parts.append(f"{steps} steps{resumed} in {summary['fit_s']:.1f} s")
    rates = summary.get("throughput") or {}
    kind = "tokens" if "tokens_per_sec" in rates else "samples"
    if rates:
        per_device = rates[f"{kind}_per_sec_per_device"]
        parts.append(f"{rates[f'{kind}_per_sec']:.0f} {kind}/s ({per_device:.0f} per device)")
    if "mfu" in rates:
        parts.append(f"MFU {100 * rates['mfu']:.1f}%")
    if "stages" in summary:
        peaks = ", ".join(human(s.peak_activation_bytes) for s in summary["stages"])
        parts.append(f"peak activations per stage [{peaks}]")
    parts.append(f"-> {summary['output_dir']}")
    return ", ".join(parts)


def _config_error(error: Optional[BaseException]) -> Optional[BaseException]:
    """The configuration mistake behind ``error``, if it is one (Hydra's
    instantiate wraps the errors of the objects it builds), or a checkpoint the
    filesystem refused (full, over quota, read-only): pipeckpt's message says it all."""
    while error is not None:
        if isinstance(error, (PipeckptConfigError, PipeckptSaveError, FileNotFoundError)):
            return error
        error = error.__cause__ or error.__context__
    return None


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> None:
    try:
        check_config(cfg)  # before anything is built: a bad value costs no corpus, model or Trainer
        summary = train(cfg)
    except Exception as error:
        mistake = _config_error(error)
        if mistake is None:
            raise
        _refuse(mistake)
    if summary["is_global_zero"]:
        print(_summary_line(summary), flush=True)


def _refuse(mistake: BaseException) -> None:
    """A configuration mistake is the user's to fix: the message says how; a traceback would bury it."""
    kinds = {PipeckptCheckpointError: "Checkpoint error", PipeckptSaveError: "Checkpoint not saved"}
    kind = next((name for cls, name in kinds.items() if isinstance(mistake, cls)), "Configuration error")
    print(f"{kind}: {mistake}", file=sys.stderr, flush=True)
    sys.exit(1)


if __name__ == "__main__":
    try:
        check_overrides(sys.argv[1:])  # what Hydra's parser would refuse without saying why
    except PipeckptConfigError as mistake:
        _refuse(mistake)
    main()
