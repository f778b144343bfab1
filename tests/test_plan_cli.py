"""``python -m pipeckpt.plan``: composes the configs, profiles, prints a row per stage, draws the PNG."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _plan(*overrides: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.run(
        [sys.executable, "-m", "pipeckpt.plan", *overrides],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_the_plan_command_prints_one_row_per_stage_and_writes_the_png(tmp_path: Path) -> None:
    png = tmp_path / "plan.png"
    result = _plan(
        "model=mlp",
        "strategy.stages=3",
        "ckpt=always",
        "+memory.budget=1MiB",
        f"memory.png={png}",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:3] == ["stage", "layers", "mode"])
    rows = [line.split() for line in lines[header + 1 : header + 4]]
    assert [row[0] for row in rows] == ["0", "1", "2"]
    assert all(row[2] == "always" and row[-1] == "fits" for row in rows)
    assert any(line.startswith("auto under 1.0 MiB: checkpoint=") for line in lines)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_bad_budget_is_a_configuration_error(tmp_path: Path) -> None:
    result = _plan("model=mlp", "+memory.budget=lots", cwd=tmp_path)
    assert result.returncode == 1
    assert "Configuration error: memory budget 'lots'" in result.stderr
