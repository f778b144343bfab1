"""bf16-mixed on CPU under both engines: which dtype each tensor has.

Autocast runs the matrix products in bf16, so activations crossing stage boundaries are bf16
(the first stage's input is the fp32 batch); the recompute of a checkpointed stage runs under
the forward's autocast again; gradients, weights (the master copy) and optimizer state stay fp32.
"""

import json
from pathlib import Path
from typing import Dict, List

import pytest
from precision_worker import DtypeRecorder
from support import ranks
from support.paths import REPO
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


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["always"])
def test_distributed_engine_bf16_mixed_keeps_activations_bf16_and_gradients_weights_state_fp32(
    tmp_path, mode
):
    env = ranks.rank_env(2)
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
