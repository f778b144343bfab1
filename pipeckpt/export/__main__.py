"""``python -m pipeckpt.export CKPT OUT [--prefix model. --config DIR]``: a run's checkpoint as a
Hugging Face directory (:func:`pipeckpt.export.export_hf`). After a run of the app's ``model=hf``
the checkpoint names its prefix and config itself. A refusal is one line on stderr, exit status 2
(a setting) or 1 (the filesystem refused the export), never a traceback."""

import argparse
from typing import List, Optional

from pipeckpt._errors import PipeckptConfigError, PipeckptSaveError
from pipeckpt.export.hf import export_hf

__all__ = ["main"]


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m pipeckpt.export",
        description="Write a pipeckpt checkpoint (a sharded directory or a .ckpt file) as a directory "
        "that Hugging Face from_pretrained loads: config.json, model-only safetensors shards and index, "
        "and the pretrained directory's tokenizer and generation files.",
    )
    parser.add_argument("checkpoint", help="a .ckpt file (local engine) or a sharded directory (distributed)")
    parser.add_argument("out", help="a new directory, or an earlier export's (replaced whole)")
    parser.add_argument("--prefix", help="the HF model's attribute path, e.g. 'model.' (default: the "
                        "checkpoint's, after a model=hf run)")  # fmt: skip
    parser.add_argument("--config", help="the pretrained directory (or its config.json); default: the "
                        "checkpoint's, after a model=hf run")  # fmt: skip
    parser.add_argument("--model-class", help="the transformers class (default: the config's architectures)")
    parser.add_argument("--adapter-config", help="a PEFT adapter directory (or adapter_config.json): "
                        "write the adapters of the PEFT model at --prefix instead")  # fmt: skip
    parser.add_argument("--dtype", default="source", choices=["source", "checkpoint", "float32", "bfloat16"],
                        help="source (default): the pretrained dir's; checkpoint: as saved")  # fmt: skip
    parser.add_argument("--max-shard-size", default="5GB", help="bytes, or e.g. 5GB, 500MB (default 5GB)")
    args = parser.parse_args(argv)
    try:
        export_hf(
            args.checkpoint,
            args.out,
            prefix=args.prefix,
            config=args.config,
            model_class=args.model_class,
            adapter_config=args.adapter_config,
            dtype=args.dtype,
            max_shard_size=int(size) if (size := args.max_shard_size).isdigit() else size,
        )
    except PipeckptConfigError as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    except PipeckptSaveError as error:
        parser.exit(1, f"{parser.prog}: error: {error}\n")


if __name__ == "__main__":
    main()
