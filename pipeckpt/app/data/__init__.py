"""DataModules for the example app: a text corpus (in bytes, or in Hugging Face batches), the user's
own dataset files, and seeded synthetic data."""

from pipeckpt.app.data.dataset import DatasetDataModule
from pipeckpt.app.data.hf_text import HFTextDataModule
from pipeckpt.app.data.synthetic import SyntheticImages, SyntheticTokens, SyntheticVectors
from pipeckpt.app.data.text import TextDataModule

__all__ = [
    "TextDataModule",
    "HFTextDataModule",
    "DatasetDataModule",
    "SyntheticTokens",
    "SyntheticVectors",
    "SyntheticImages",
]
