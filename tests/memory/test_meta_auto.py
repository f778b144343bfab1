"""``checkpoint="auto"`` on a module built on the meta device, in one process: the meta build
profiled on fake tensors (memory/fake_weights.py) against the same model built eagerly. Tiny
Hugging Face Llama and GPT-2 (tied head) from their configs (tests/support/pretrained_models.py)
through ``pipeline_of``, their loader's first batch (8 x 12 tokens) cut into 2 micro-batches,
balance [2, 2], GPipe, SGD."""

from typing import Any, Dict, List, Tuple

import pytest
import torch
from support.pretrained_models import FromScratch, loader
from torch import nn

from pipeckpt._errors import PipeckptConfigError
from pipeckpt.boundaries.contract import pipelined_sequential
from pipeckpt.checkpointing.modes import NEVER
from pipeckpt.memory.auto import DEFAULT_MODES, with_balance_modes
from pipeckpt.memory.budget import first_microbatch, resolve_auto, sample_batch
from pipeckpt.memory.fake_weights import fake_weights, state_bytes
from pipeckpt.memory.predict import predict, with_balance
from pipeckpt.memory.profile import ModelProfile, profile
from pipeckpt.settings import PipeSettings

CPU = torch.device("cpu")
OPTIONS: Dict[str, Any] = dict(chunks=2, optimizer="sgd", schedule="gpipe")


def _builds(name: str) -> Tuple[FromScratch, FromScratch, Any]:
    """(eager build, meta build, one batch of the pipeline's input)."""
    eager = FromScratch(name, build="eager")
    meta = FromScratch(name, build="meta")
    with torch.device("meta"):
        meta.configure_model()
    batch, _, _ = sample_batch(eager, loader(), pipelined_sequential(eager))
    return eager, meta, batch


def _peaks(fitted: ModelProfile) -> Dict[str, List[int]]:
    """Each default mode's predicted peak per stage."""
    out = {}
    for mode in DEFAULT_MODES:
        prediction = predict(fitted, with_balance_modes((2, 2), mode), **OPTIONS)
        out[mode.name] = [s.peak for s in prediction.stages]
    return out


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_the_fake_profile_of_a_meta_build_predicts_the_eager_builds_peaks(name: str) -> None:
    eager, meta, batch = _builds(name)
    micro = first_microbatch(batch, 2)
    want = _peaks(profile(pipelined_sequential(eager), micro, rounds=1))
    with fake_weights(meta, CPU):
        got = _peaks(profile(pipelined_sequential(meta), micro, fake=True))
    # The storages are the same sizes. MemTracker's peaks of the small tensors a layer makes (scalars,
    # indices) vary by a few hundred bytes from one process to the next, on real and fake tensors
    # alike (GPT-2: up to 768 bytes, 0.1%): within 1 KiB of each peak.
    for mode in want:
        for g, w in zip(got[mode], want[mode]):
            assert abs(g - w) <= 1024, (mode, got[mode], want[mode])


def test_fake_weights_hand_the_meta_tensors_back_tied_ones_tied() -> None:
    _, meta, _ = _builds("gpt2")
    before = {k: id(t) for k, t in meta.named_parameters(remove_duplicate=False)}
    with fake_weights(meta, CPU):
        inside = dict(meta.named_parameters(remove_duplicate=False))
        assert not any(t.is_meta for t in inside.values())
        assert inside["model.lm_head.weight"] is inside["model.transformer.wte.weight"]
    after = {k: id(t) for k, t in meta.named_parameters(remove_duplicate=False)}
    assert after == before
    assert all(t.is_meta for t in meta.parameters())
    assert meta.model.lm_head.weight is meta.model.transformer.wte.weight


def test_state_bytes_of_a_meta_build_are_the_eager_builds_counted_once() -> None:
    eager, meta, _ = _builds("gpt2")
    tensors = {id(t): t for t in (*eager.parameters(), *eager.buffers())}
    assert state_bytes(meta) == sum(t.untyped_storage().nbytes() for t in tensors.values())


def test_where_several_plans_fit_the_meta_builds_pick_fits_by_the_eager_profile() -> None:
    # 620,000 bytes: stage 0 fits every mode, stage 1 all but never. Times on fake tensors come
    # from FLOP counts, so the pick among plans that fit may differ from the eager build's
    # (docs/MEMORY.md); what must not differ is that it fits.
    eager, meta, batch = _builds("llama")
    settings = PipeSettings(
        engine="distributed", checkpoint="auto", stages=2, chunks=2, schedule="gpipe",
        memory_budget=620_000, memory_optimizer="sgd",
    )  # fmt: skip
    devices = [CPU, CPU]
    on_eager = resolve_auto(settings, pipelined_sequential(eager), devices=devices, batch=batch)
    with fake_weights(meta, CPU):
        on_meta = resolve_auto(settings, pipelined_sequential(meta), devices=devices, batch=batch, fake=True)
    picked = on_meta.choice
    plan = with_balance(with_balance_modes(picked.balance, NEVER), picked.balance, picked.modes)
    peaks = [s.peak for s in predict(on_eager.profiles[picked.chunks], plan, **OPTIONS).stages]
    assert all(p <= 620_000 for p in peaks), (picked.modes, peaks)


class _ReadsAValue(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * float(x.sum().item() > 0)


def test_a_meta_build_whose_step_reads_a_value_is_a_config_error_naming_it() -> None:
    with torch.device("meta"):
        module = _ReadsAValue()
    with pytest.raises(PipeckptConfigError) as caught:
        with fake_weights(module, CPU):
            module(torch.ones(2, 4))
    said = str(caught.value)
    assert "checkpoint='auto' with _ReadsAValue built on the meta device" in said
    assert "fake tensors" in said and "build the module eagerly" in said
