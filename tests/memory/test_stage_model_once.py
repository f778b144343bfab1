"""pipeckpt.memory.stage_model.stage_model: a stage's numbers made once per profile and shared by
every prediction after, which then predict exactly what a fresh profile predicts."""

from dataclasses import replace

import torch
import torch.nn.functional as F
from harness.stage_memory import split_batch

from pipeckpt.app.models.mlp import mlp_layers
from pipeckpt.checkpointing.modes import parse_modes
from pipeckpt.memory.auto import DEFAULT_MODES, with_balance_modes
from pipeckpt.memory.predict import predict, with_balance
from pipeckpt.memory.profile import profile
from pipeckpt.memory.stage_model import stage_model


def _profile():
    torch.manual_seed(0)
    seq = mlp_layers(in_features=16, hidden=64, depth=4, num_classes=10)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 16, generator=g), torch.randint(10, (16,), generator=g)
    return profile(seq, split_batch(x, 2), loss_fn=F.cross_entropy, target=split_batch(y, 2), rounds=1)


PROFILE = _profile()
BALANCE = (3, 3, 3)


def _predicted(p, modes, chunks, schedule):
    plan = with_balance(with_balance_modes(BALANCE, DEFAULT_MODES[0]), BALANCE, parse_modes(modes, 3))
    return predict(p, plan, chunks=chunks, optimizer="adamw", schedule=schedule)


def test_a_stage_is_made_once_per_profile_and_anew_for_a_changed_one() -> None:
    one = stage_model(PROFILE, 0, 3, first=True, last=False, local=False)
    assert stage_model(PROFILE, 0, 3, first=True, last=False, local=False) is one
    assert stage_model(PROFILE, 0, 3, first=True, last=False, local=True) is not one
    assert stage_model(replace(PROFILE), 0, 3, first=True, last=False, local=False) is not one


def test_predictions_over_shared_stages_equal_a_fresh_profiles() -> None:
    shared = PROFILE
    cases = [
        (["never", "always", "except_last"], 4, "1f1b"),
        (["always", "always", "always"], 2, "gpipe"),
        (["never", "always", "except_last"], 8, "gpipe"),
        (["offload", "never", "always"], 4, "local"),
        (["selective", "always:2", "never"], 4, "1f1b"),
    ]
    for modes, chunks, schedule in cases + cases:  # the second round reads every stage from the first's
        fresh = replace(PROFILE)  # nothing derived yet
        assert _predicted(shared, modes, chunks, schedule) == _predicted(fresh, modes, chunks, schedule)
