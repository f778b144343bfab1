"""``python -m pipeckpt.export CKPT OUT --prefix model. --config DIR``: a run's checkpoint as a
Hugging Face directory (:func:`pipeckpt.export.export_hf`)."""

import argparse
from typing import List, Optional

from pipeckpt._errors import PipeckptConfigError
from pipeckpt.export.hf import export_hf

__all__ = ["main"]


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m pipeckpt.export",
        description="Write a pipeckpt checkpoint (a sharded directory or a .ckpt file) as a directory "
        "that Hugging Face from_pretrained loads: config.json, model-only safetensors shards and index.",
    )
    parser.add_argument("checkpoint", help="a .ckpt file (local engine) or a sharded directory (distributed)")
    parser.add_argument("out", help="the directory to write (replaced whole if it exists)")
    parser.add_argument("--prefix", required=True, help="the HF model's attribute path, e.g. 'model.'")
    parser.add_argument("--config", required=True, help="a directory holding config.json, or that file")
    parser.add_argument("--model-class", help="the transformers class (default: the config's architectures)")
    parser.add_argument("--adapter-config", help="a PEFT adapter directory (or adapter_config.json): "
                        "write the adapters of the PEFT model at --prefix instead")  # fmt: skip
    parser.add_argument("--dtype", default="keep", choices=["keep", "float32", "bfloat16"])
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


if __name__ == "__main__":
    main()
