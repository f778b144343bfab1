"""bf16-mixed on CPU under both engines: which dtype each tensor has.

Autocast runs the matrix products in bf16, so activations crossing stage boundaries are bf16
(the first stage's input is the fp32 batch); the recompute of a checkpointed stage runs under
the forward's autocast again; gradients, weights (the master copy) and optimizer state stay fp32.
"""

import json
import os
import socket
from pathlib import Path
from typing import Dict, List

import pytest
from precision_worker import DtypeRecorder
from support import ranks
from support.paths import REPO, worker_pythonpath
from support.toy import ToyModule, fit

from pipeckpt import PipelineStrategy

HERE = Path(__file__).parent
BF16, FP32 = ["torch.bfloat16"], ["torch.float32"]


def expected(stages: int, recomputes: bool) -> Dict[str, List[str]]:
    seen = {"stage 0 input": FP32, "Linear output": BF16, "gradient": FP32, "weight": FP32}
    seen.update({f"stage {j} input": BF16 for j in range(1, stages)})
    seen.update({f"stage {j} output": BF16 for j in range(stages)})
    seen["optimizer state"] = FP32
    if recomputes:
        seen["recomputed Linear output"] = BF16
    return seen


@pytest.mark.parametrize("mode", ["never", "always"])
def test_local_engine_bf16_mixed_keeps_activations_bf16_and_gradients_weights_state_fp32(mode):
    recorder = DtypeRecorder()
    module = ToyModule()
    strategy = PipelineStrategy(balance=[2, 2, 2], chunks=4, checkpoint=mode)
    fit(module, strategy, steps=2, precision="bf16-mixed", callbacks=[recorder])
    assert recorder.as_lists() == expected(3, recomputes=mode == "always")
    assert {str(p.dtype) for p in module.parameters()} == set(FP32)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["always"])
def test_distributed_engine_bf16_mixed_keeps_activations_bf16_and_gradients_weights_state_fp32(
    tmp_path, mode
):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC", "PL_"))}
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        WORLD_SIZE="2",
        NODE_RANK="0",
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="ignore",
        PYTHONPATH=worker_pythonpath(),
    )
    procs: List[ranks.Rank] = []
    try:
        for rank in range(2):
            worker, log = HERE / "precision_worker.py", tmp_path / f"rank{rank}.log"
            env_r = dict(env, LOCAL_RANK=str(rank))
            procs.append(ranks.spawn(worker, [str(tmp_path), mode], env_r, rank, REPO, log))
        codes = [p.wait(timeout=300) for p in procs]
    finally:
        ranks.stop(procs)
    logs = "\n".join((tmp_path / f"rank{r}.log").read_text(errors="replace")[-3000:] for r in range(2))
    assert codes == [0, 0], logs
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    everything = expected(2, recomputes=mode == "always")
    rank0 = {k: v for k, v in everything.items() if not k.startswith("stage 1")}
    rank1 = {k: v for k, v in everything.items() if not k.startswith("stage 0")}
    assert seen == [rank0, rank1]
