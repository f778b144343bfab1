"""DataModules for the example app: a text corpus (in bytes, or in Hugging Face batches) and seeded
synthetic data."""

from pipeckpt.app.data.hf_text import HFTextDataModule
from pipeckpt.app.data.synthetic import SyntheticImages, SyntheticTokens, SyntheticVectors
from pipeckpt.app.data.text import TextDataModule

__all__ = ["TextDataModule", "HFTextDataModule", "SyntheticTokens", "SyntheticVectors", "SyntheticImages"]
