"""Memory sizes as users write them (``20GiB``) and as pipeckpt prints them, and the
per-optimizer state factor.

Read by the settings' model-free checks, the memory model and the reports above them, so they
live below all of them; none needs torch."""

import re
from typing import Dict, List, Optional, Union

from pipeckpt._errors import config_error

__all__: List[str] = ["MiB", "OPTIMIZERS", "human", "parse_bytes"]

#: Optimizer state per parameter, in units of the parameter's bytes (Adam's step counters aside).
OPTIMIZERS: Dict[str, float] = {"sgd": 0.0, "momentum": 1.0, "adam": 2.0, "adamw": 2.0}

#: Bytes in a mebibyte, the unit of pipeckpt's logged and charted figures.
MiB = 2**20

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "K": 2**10, "M": 2**20, "G": 2**30})


def parse_bytes(value: Union[int, float, str], name: Optional[str] = None) -> int:
    """``2GiB``, ``1.5 GB``, ``512MiB`` or a plain number of bytes, as bytes.

    Args:
        value: the size, a number of bytes or a string with a unit.
        name: the setting as its user wrote it (``memory_budget`` in Python, ``memory.budget`` in
            the app), so that a refusal names what to fix; without it, the refusal names the value.
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number, unit = float(value), ""
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(value))
        number, unit = (float(match.group(1)), match.group(2).upper()) if match else (-1.0, "?")
    if unit not in _UNITS or number <= 0:
        raise config_error(
            f"{name}={value!r}" if name else repr(value),
            "is not a size, which is a positive number of bytes or a number with a unit "
            "(KiB, MiB, GiB, TiB, KB, MB, GB, TB)",
            "write it as e.g. 12GiB or 800MB",
        )
    return int(number * _UNITS[unit])


def human(n: float) -> str:
    """``n`` bytes in the largest binary unit that keeps it at or above 1: ``1536`` -> ``1.5 KiB``.

    Args:
        n: a number of bytes.
    """
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"
