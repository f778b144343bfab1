"""The machine line every results table starts with, shared by the benchmark scripts."""

import datetime
import platform

import lightning as L
import torch


def machine() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        names = []
    cpu = names[0] if names else platform.processor() or "unknown CPU"
    try:
        import torchgpipe

        gpipe = f", torchgpipe {torchgpipe.__version__}"
    except ImportError:
        gpipe = ""
    return (
        f"{cpu}, {len(names) or '?'} cores, torch {torch.__version__}{gpipe}, lightning "
        f"{L.__version__}, Python {platform.python_version()}, {datetime.date.today().isoformat()}"
    )
