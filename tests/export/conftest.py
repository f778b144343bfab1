"""What the export tests share: a record of every read an export makes of its checkpoint."""

from typing import List

import pytest

from pipeckpt.export import source as export_source


@pytest.fixture
def source_reads(monkeypatch) -> List[List[str]]:
    """The keys of each ``CheckpointSource.read`` an export makes, in order (the reads still run)."""
    reads: List[List[str]] = []
    original = export_source.CheckpointSource.read
    monkeypatch.setattr(
        export_source.CheckpointSource,
        "read",
        lambda self, keys: reads.append(list(keys)) or original(self, keys),
    )
    return reads
