"""The resume matrix: one run with dropout on, resumed through four layouts.

local 4 stages -> local 2 stages -> distributed, 2 processes x 1 stage -> local 1 stage, one epoch
(4 steps) each, every leg resuming the checkpoint the previous one wrote at its epoch's end (where
Lightning resumes a plain DataLoader exactly). With per-layer random streams the dropout masks of
every leg are the uninterrupted run's, so the chain ends where that run ends."""

from pathlib import Path
from typing import Any

import pytest
import support.ranks as ranks
from lightning.pytorch.callbacks import ModelCheckpoint
from support.toy import ToyModule, fit, max_relative_difference, params
from test_distributed_engine import START_S, WORKER

from pipeckpt import PipelineStrategy
from pipeckpt.state import sharded

EPOCH = 4  # steps: 64 samples in batches of 16
DROPOUT = 0.3
CHUNKS = 4  # the same in every leg: a mask depends on which samples form a micro-batch


def _leg(strategy: PipelineStrategy, until: int, resume: Any, out: Path, seed: int) -> ToyModule:
    """Trains up to step ``until`` from ``resume``; checkpoints every epoch into ``out``. ``seed``: of
    the initial weights (a resumed leg's are the checkpoint's, whatever they were)."""
    module = ToyModule(dropout=DROPOUT, seed=seed)
    every_epoch = ModelCheckpoint(dirpath=out, every_n_train_steps=EPOCH, save_top_k=-1)
    fit(module, strategy, steps=until, ckpt_path=resume, callbacks=[every_epoch], enable_checkpointing=True)
    return module


def _distributed_leg(resume: Path, out: Path) -> Path:
    """Two processes, one stage each, resume ``resume`` and train one more epoch."""
    run = dict(
        name="distributed",
        strategy=dict(balance=[3, 3], chunks=CHUNKS, schedule="1f1b", checkpoint="except_last"),
        dropout=DROPOUT,
        steps=3 * EPOCH,
        checkpoint_every=EPOCH,
        resume=str(resume),
    )
    ranks.launch(WORKER, 2, [run], out, within_s=START_S)
    written = out / "distributed" / f"epoch=2-step={3 * EPOCH}.ckpt"
    assert sharded.is_sharded(written)
    return written


@pytest.mark.slow
def test_a_run_resumed_through_four_layouts_ends_like_the_uninterrupted_run(tmp_path):
    _leg(
        PipelineStrategy(balance=[1, 2, 2, 1], chunks=CHUNKS, checkpoint="always"),
        EPOCH,
        None,
        tmp_path / "a",
        0,  # ToyModule()'s weights, as the uninterrupted run's
    )
    _leg(
        PipelineStrategy(balance=[3, 3], chunks=CHUNKS, checkpoint="offload"),
        2 * EPOCH,
        tmp_path / "a" / f"epoch=0-step={EPOCH}.ckpt",
        tmp_path / "b",
        2,
    )
    third = _distributed_leg(tmp_path / "b" / f"epoch=1-step={2 * EPOCH}.ckpt", tmp_path)
    chained = _leg(
        PipelineStrategy(stages=1, chunks=CHUNKS, checkpoint="never"), 4 * EPOCH, third, tmp_path / "d", 3
    )

    uninterrupted = fit(
        ToyModule(dropout=DROPOUT), PipelineStrategy(balance=[3, 3], chunks=CHUNKS), steps=4 * EPOCH
    )
    reference = params(uninterrupted.lightning_module)
    assert max_relative_difference(params(chained), reference) < 1e-6
    initial = ToyModule(dropout=DROPOUT).state_dict()
    assert max_relative_difference(params(chained), initial) > 1e-3  # it trained


@pytest.mark.slow
def test_without_layer_streams_the_chain_departs_from_the_uninterrupted_run(tmp_path):
    # The local legs alone, layer_rng='off': the masks follow the layout, so the comparison above fails.
    def off(**kwargs: Any) -> PipelineStrategy:
        return PipelineStrategy(chunks=CHUNKS, layer_rng="off", **kwargs)

    _leg(off(balance=[1, 2, 2, 1]), EPOCH, None, tmp_path / "a", 0)
    chained = _leg(off(stages=1), 2 * EPOCH, tmp_path / "a" / f"epoch=0-step={EPOCH}.ckpt", tmp_path / "b", 2)
    reference = params(fit(ToyModule(dropout=DROPOUT), off(balance=[3, 3]), steps=2 * EPOCH).lightning_module)
    assert max_relative_difference(params(chained), reference) > 1e-3
