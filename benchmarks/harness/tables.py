"""Writing a results table as a benchmark goes, shared by the benchmark scripts."""

from pathlib import Path
from typing import Optional, Sequence


def emit(lines: Sequence[str], out: Optional[Path]) -> None:
    """Prints the table so far and writes it to ``out``: called after each part, so a run cut short
    (a device run's timeout) keeps what it measured."""
    text = "\n".join(lines) + "\n"
    print(text, flush=True)
    if out is not None:
        out.write_text(text)
