"""The import-linter contracts in pyproject.toml are live: an upward import breaks them.

A contract that names a module wrongly, or a layer list that no longer matches the
package, would pass silently; this test adds one upward import to a copy of the
package and asserts that ``lint-imports`` reports that very import under the layers
contract. It asserts on the injected import, not only on the exit status, so it
holds whatever else in the tree is still in flux.
"""

import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

pytest.importorskip("importlinter", reason="import-linter is installed by scripts/check.sh or the dev extra")

REPO = Path(__file__).resolve().parents[1]
LAYERS_CONTRACT = "Layers: CLIs > app > report > strategy > memory > engines > stages > checkpointing > base"
# _rng is in the bottom layer, planning two layers above it; planning does not import
# _rng, so the added import breaks the layering without also making a cycle.
INJECTED = "pipeckpt._rng -> pipeckpt.stages.partition"


def _lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` run in ``root``; it puts its working directory first on sys.path."""
    executable = Path(sysconfig.get_path("scripts")) / "lint-imports"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # read the copy, nothing else
    return subprocess.run(
        [str(executable), "--no-cache", "--no-logo"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _broken_section(report: str, contract: str) -> str:
    """One contract's part of the "Broken contracts" report, whitespace collapsed:
    from its underlined title to the next title's underline."""
    text = " ".join(report.split())
    broken = text.split("Broken contracts ---", 1)[1]
    after_title = broken.split(f"{contract} ---", 1)[1].lstrip("- ")
    return after_title.split(" ---", 1)[0]


def test_an_upward_import_breaks_the_layers_contract(tmp_path: Path) -> None:
    shutil.copytree(REPO / "pipeckpt", tmp_path / "pipeckpt", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    rng = tmp_path / "pipeckpt" / "_rng.py"
    rng.write_text(rng.read_text() + "\nimport pipeckpt.stages.partition  # noqa: E402, F401\n")

    result = _lint_imports(tmp_path)

    report = result.stdout + result.stderr
    assert result.returncode == 1, report
    assert f"{LAYERS_CONTRACT} BROKEN" in " ".join(report.split()), report
    assert INJECTED in _broken_section(report, LAYERS_CONTRACT), report
