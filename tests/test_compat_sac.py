"""The private torch names compiled selective checkpointing uses (pipeckpt/_compat/torch_private.py)."""

import torch

from pipeckpt import _compat


def test_sac_stateful_ops_resolve_the_batch_norm_kernels_of_this_torch():
    ops = _compat.sac_stateful_ops()
    assert len(ops) == len(_compat.SAC_STATEFUL_OP_NAMES)  # every name exists in torch 2.13
    assert torch.ops.aten._native_batch_norm_legit in ops  # what BatchNorm1d's training forward runs
    schema = torch.ops.aten._native_batch_norm_legit.default._schema
    written = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    assert written == ["running_mean", "running_var"]  # why a compiled region must not recompute it
