"""The layout search's measured validation (``bench_layout_measured.py``) runs end to end on a tiny
GPT over 2 gloo processes: a row per measured layout, and every rank's predicted peak within 10% of
the bytes it held (memory is exact on CPU, so this holds on any load; times are not asserted). The
figures it calibrates stay in a cache of its own: the user's cached ``cluster=local`` file is left as
it was."""

import re
from pathlib import Path

import pytest
from support.benchmarks import run_benchmark

from pipeckpt.layout import calibrate


@pytest.mark.slow
def test_every_measured_layout_has_a_row_and_its_peaks_within_ten_percent(
    tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    users = calibrate.cache_file()  # what the user's own searches cached
    users.parent.mkdir(parents=True)
    users.write_text('{"cores": 2, "written": "by the user"}')
    out = tmp_path / "measured.md"
    args = ["--quick", "--rounds", "1", "--warmup", "1", "--timed", "1", "--out", str(out)]
    run_benchmark("bench_layout_measured.py", *args, env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert users.read_text() == '{"cores": 2, "written": "by the user"}'
    assert list(users.parent.iterdir()) == [users]
    text = out.read_text()
    rows = [line for line in text.splitlines() if re.match(r"\| \d+ \| pp\d", line)]
    layouts = {row.split("|")[2].strip() for row in rows}
    assert {"pp1 x tp1 x dp2 gpipe x1", "pp2 x tp1 x dp1 gpipe x1", "pp2 x tp1 x dp1 1f1b x2"} <= layouts
    errors = [float(e) for row in rows for e in re.findall(r"([+-]\d+\.\d)%", row.split("|")[9])]
    assert len(errors) >= len(rows)
    assert all(abs(e) <= 10.0 for e in errors), text
    assert "Spearman rank correlation" in text
