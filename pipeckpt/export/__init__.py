"""Back to Hugging Face: a run's checkpoint as a directory ``from_pretrained`` loads.

``export_hf(checkpoint, out, prefix="model.", config=...)`` (and ``python -m pipeckpt.export``)
writes config.json, model-only safetensors shards and their index, or a PEFT model's adapters, one
shard at a time from any checkpoint of either engine; ``HFExport`` does it at the end of ``fit``.
Needs ``pip install "pipeckpt[hf]"`` (transformers; peft for adapters).
"""

from pipeckpt.export.callback import HFExport
from pipeckpt.export.hf import export_hf

__all__ = ["HFExport", "export_hf"]  # the public API of the export layer
