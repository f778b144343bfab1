"""A real two-node SLURM cluster (scripts/slurm_cluster.sh) for the tests in this folder.

The cluster is started once per session in a temporary folder and always stopped. Without the SLURM
packages the tests skip, except in CI (`CI` set), where they fail: `.ci/run` installs the packages
with scripts/install_slurm.sh, and a silent skip there would hide a broken setup.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator

import pytest
from slurm_helpers import CLUSTER, HERE, PYTHON, ROOT, Slurm, unavailable


@pytest.fixture(scope="session")
def slurm_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Starts the cluster; yields the environment that client commands and jobs need."""
    missing = [tool for tool in ("slurmctld", "slurmd", "sbatch", "munged") if shutil.which(tool) is None]
    if missing:
        unavailable(f"SLURM is not installed (missing {', '.join(missing)}); run scripts/install_slurm.sh")
    if os.geteuid() != 0:
        unavailable("the local SLURM cluster needs root (slurmd, unshare --uts --mount)")

    state = tmp_path_factory.mktemp("cluster")
    env = dict(os.environ)
    env.update(
        SLURM_CONF=str(state / "slurm.conf"),
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), str(HERE), env.get("PYTHONPATH")) if p),
        PYTHONUNBUFFERED="1",
        PYTHON=PYTHON,  # the interpreter the job scripts run (this one, with its packages)
    )
    # Variables of an enclosing allocation would leak into our jobs' environment.
    for key in [k for k in env if k.startswith(("SLURM_", "SBATCH_", "SRUN_")) and k != "SLURM_CONF"]:
        del env[key]
    try:
        started = subprocess.run(
            ["bash", str(CLUSTER), "start", str(state)], capture_output=True, text=True, timeout=120
        )
        if started.returncode != 0:
            pytest.fail(
                f"could not start the SLURM cluster:\n{started.stdout}\n{started.stderr}", pytrace=False
            )
        yield env
    finally:
        subprocess.run(["bash", str(CLUSTER), "stop", str(state)], capture_output=True, timeout=120)


@pytest.fixture
def slurm(slurm_env: dict[str, str]) -> Iterator[Slurm]:
    client = Slurm(dict(slurm_env))
    try:
        yield client
    finally:
        client.cancel_all()
