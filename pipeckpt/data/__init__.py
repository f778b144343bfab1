"""DataModules for the example app: a byte-level text corpus and seeded synthetic data."""

from pipeckpt.data.synthetic import SyntheticImages, SyntheticTokens, SyntheticVectors
from pipeckpt.data.text import TextDataModule

__all__ = ["TextDataModule", "SyntheticTokens", "SyntheticVectors", "SyntheticImages"]
