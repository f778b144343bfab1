"""A user's own training script, no configs: ``PipelineStrategy(layout="auto")`` (or one device,
Lightning's default strategy, for the same numbers to compare) trains HF GPT-2 behind a user's glue
(:mod:`support.user_modules`) for two steps and validates once. Global rank 0 writes what it
measured as JSON to ``--out``. Run as a script: Lightning's launcher runs it again for every other
rank, as it runs a user's.

    python tests/support/auto_script.py --out result.json [--auto --cluster h100_8 --set dp=2]
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: `support` as the search names it

import lightning as L
from lightning.pytorch.loggers import CSVLogger

from pipeckpt import PipelineStrategy
from support.user_modules import UserGPT2, UserTokens


def _value(text: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--auto", action="store_true")
    parser.add_argument("--cluster", default="h100_8")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--set", action="append", default=[], help="NAME=VALUE: a strategy setting")
    args = parser.parse_args()
    L.seed_everything(0, verbose=False)
    model = UserGPT2(layers=4, width=64, heads=4, dropout=0.0)
    data = UserTokens(batch_size=8, seq_len=32, samples=16)
    common = dict(
        accelerator="cpu",
        max_steps=2,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    if args.auto:
        named = dict(s.split("=", 1) for s in args.set)
        settings = {k: _value(v) for k, v in named.items()}
        strategy = PipelineStrategy(
            engine="distributed", layout="auto", cluster=args.cluster, timeout=300, **settings
        )
        logger = CSVLogger(Path(args.out).parent, name="logs")  # the pick among its hyperparameters
        trainer = L.Trainer(strategy=strategy, devices=args.devices, **{**common, "logger": logger})
    else:
        trainer = L.Trainer(devices=1, **common)
    trainer.fit(model, datamodule=data)
    if trainer.is_global_zero:
        search = getattr(trainer.strategy, "layout_search", None)
        result = {
            "val_loss": float(trainer.callback_metrics["val_loss"]),
            "pick": search.pick["settings"] if search is not None else None,
        }
        Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
