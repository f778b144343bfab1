"""The search's memory function makes each stage's per-rank state once per sharding (tensor-parallel
and FSDP degrees, reshard policy), and the stages' balance once per stage count, not once per
micro-batch count and schedule: made anew for each, the per-rank states were about a third of a
512-GPU search's time (Llama 3.1 405B on h100_8x8), the balance a quarter once they were shared.
The answers are the same as a memory function asked of one layout alone."""

from typing import Any, List

import pytest
import torch
from torch import nn

from pipeckpt.layout import fit
from pipeckpt.layout.candidates import Candidate
from pipeckpt.layout.fit import Memory, Shapes
from pipeckpt.memory.profile import profile


def _linears() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(4)])


def _shapes(model: nn.Sequential) -> Shapes:
    def profile_of(tp: int, microbatch: int, sequence: bool = False) -> Any:
        x = torch.randn(microbatch, 16)
        return profile(model, x, loss_fn=lambda out, t: out.pow(2).mean(), target=None)

    return Shapes(layers=lambda tp: (model, ()), profile=profile_of)  # type: ignore[arg-type]


def _bytes(memory: Memory, c: Candidate) -> Any:
    """What a fit says in bytes (its times are the profile's, measured anew by each profile)."""
    found = memory.fit(c)
    stages = [(s.peak, s.params, s.grads, s.optimizer) for s in found.prediction.stages]
    return memory.state_bytes(c), found.candidate, found.balance, found.peaks, stages


LAYOUTS = [
    Candidate(2, 1, 1, 2, "gpipe", 1, 1),
    Candidate(2, 1, 1, 2, "gpipe", 1, 2),
    Candidate(2, 1, 1, 2, "1f1b", 1, 4),
    Candidate(2, 1, 1, 2, "interleaved_1f1b", 2, 2),
    Candidate(2, 1, 1, 2, "1f1b", 1, 2, reshard=True),
    Candidate(4, 1, 1, 1, "1f1b", 1, 4),
]


def test_rank_states_are_made_once_per_sharding_with_the_same_answers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = _linears()
    alone = []
    for c in LAYOUTS:  # one memory function per layout: nothing shared
        m = Memory(_shapes(model), device_bytes=2**30, global_batch=16)
        alone.append(_bytes(m, c))
    made: List[Any] = []
    real = fit.stage_rank_states

    def counted(*args: Any, **kwargs: Any) -> Any:
        made.append(args[1])
        return real(*args, **kwargs)

    balanced: List[int] = []
    real_balance = fit.balance_of

    def balance_counted(sequential: nn.Sequential, stages: int) -> Any:
        balanced.append(stages)
        return real_balance(sequential, stages)

    monkeypatch.setattr(fit, "stage_rank_states", counted)
    monkeypatch.setattr(fit, "balance_of", balance_counted)
    shared = Memory(_shapes(model), device_bytes=2**30, global_batch=16)
    together = [_bytes(shared, c) for c in LAYOUTS]
    assert together == alone
    # shardings: fsdp 2 kept, fsdp 2 resharded, none; each for the state (no outside parameters) and
    # for the fit (the profile's, none for a Sequential: the same key)
    assert len(made) == 3
    assert sorted(balanced) == [2, 4]  # and each stage count's balance once (it reads every parameter)
