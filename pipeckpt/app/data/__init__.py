"""DataModules for the example app: a byte-level text corpus and seeded synthetic data."""

from pipeckpt.app.data.synthetic import SyntheticImages, SyntheticTokens, SyntheticVectors
from pipeckpt.app.data.text import TextDataModule

__all__ = ["TextDataModule", "SyntheticTokens", "SyntheticVectors", "SyntheticImages"]
