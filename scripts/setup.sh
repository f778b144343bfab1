#!/usr/bin/env bash
# Installs pipeckpt and its dependencies without ever replacing a torch you have.
#   bash scripts/setup.sh          # to train:   then `python train.py`
#   bash scripts/setup.sh --test   # to test:    also pytest and a local SLURM (root + apt only)
#
# torch: an installed torch (CPU or CUDA build) is kept as it is. Without one, a
# machine with an NVIDIA driver gets the registry's default (CUDA) build, and a
# CPU-only machine gets torch==2.13.0 CPU: set TORCH_INDEX to a CPU wheel index
# if your pip does not already find a CPU wheel (this project's machines do).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python || command -v python3)}
pip_install() { "$PY" -m pip install --quiet --disable-pip-version-check "$@"; }

if "$PY" -c "import torch" 2>/dev/null; then
    echo "setup: keeping installed torch $("$PY" -c 'import torch; print(torch.__version__)')"
elif command -v nvidia-smi >/dev/null 2>&1; then
    pip_install torch
else
    pip_install ${TORCH_INDEX:+--index-url "$TORCH_INDEX"} "torch==2.13.0"
fi

if [ "${1:-}" = "--test" ]; then
    pip_install -e ".[test,tensorboard,slurm]"
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        bash scripts/install_slurm.sh
    else
        echo "setup: not root or no apt-get: the SLURM tests will be skipped outside CI"
    fi
else
    pip_install -e .
fi
echo "setup: done"
