"""``python -m pipeckpt.convert SHARDED_DIR OUT.ckpt``: a sharded checkpoint as one plain file.

Why: a sharded directory needs pipeckpt (or DCP) to read; the converted file is the checkpoint
Lightning writes without pipeckpt, whose ``state_dict`` loads ``strict=True`` into the unpipelined
module, for inference, sharing or tools that expect one file. It holds the whole model in memory.
"""

import argparse
from typing import List, Optional

from pipeckpt._errors import PipeckptConfigError
from pipeckpt.state import sharded

__all__ = ["main"]


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m pipeckpt.convert",
        description="Write a sharded pipeckpt checkpoint directory as one torch.save file.",
    )
    parser.add_argument("sharded_dir", help="a directory written by the distributed engine")
    parser.add_argument("out", help="the .ckpt file to write (replaced atomically if it exists)")
    args = parser.parse_args(argv)
    try:
        sharded.to_torch_save(args.sharded_dir, args.out)
    except PipeckptConfigError as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")


if __name__ == "__main__":
    main()
