"""A mixture-of-experts model profiled on fake tensors, as a layout search on a GPU preset and a
meta build profile it: Hugging Face runs its experts by a grouped matrix product (``grouped_mm``, on a
GPU and on CPU since torch 2.11), whose meta kernel refuses float32 operands, so every such profile
failed and the search ranked no layout (pipeckpt/_compat/torch_private.py ``FakeTensorMode``). Tiny
random Mixtral and Qwen3-MoE (tests/support/moe_models.py) through ``pipeline_of``, 2 micro-batches,
balance [2, 2], GPipe, SGD."""

from typing import Dict, List

import pytest
import torch
from support.hf_models import batches
from support.moe_models import MOE, MoEModule

from pipeckpt.boundaries.contract import pipelined_sequential
from pipeckpt.memory.auto import DEFAULT_MODES, with_balance_modes
from pipeckpt.memory.budget import first_microbatch
from pipeckpt.memory.fake_weights import fake_weights
from pipeckpt.memory.predict import predict
from pipeckpt.memory.profile import ModelProfile, profile
from pipeckpt.memory.rooted import RootInput


def _peaks(fitted: ModelProfile) -> Dict[str, List[int]]:
    """Each default mode's predicted peak per stage."""
    out = {}
    for mode in DEFAULT_MODES:
        prediction = predict(
            fitted, with_balance_modes((2, 2), mode), chunks=2, optimizer="sgd", schedule="gpipe"
        )
        out[mode.name] = [s.peak for s in prediction.stages]
    return out


@pytest.mark.parametrize("name", sorted(MOE))
def test_the_fake_profile_of_a_meta_built_moe_predicts_the_eager_builds_peaks(name: str) -> None:
    eager = MoEModule(name)
    with torch.device("meta"):
        meta = MoEModule(name)
    micro = first_microbatch(RootInput((), batches(1)[0]), 2)
    want = _peaks(profile(pipelined_sequential(eager), micro, rounds=1))
    with fake_weights(meta, torch.device("cpu")):
        got = _peaks(profile(pipelined_sequential(meta), micro, fake=True))
    # the storages are the same sizes; MemTracker's peaks of a layer's small tensors (scalars,
    # indices; here the experts' routing) vary by a few hundred bytes (tests/memory/test_meta_auto.py)
    for mode in want:
        for g, w in zip(got[mode], want[mode]):
            assert abs(g - w) <= 1024, (mode, got[mode], want[mode])
