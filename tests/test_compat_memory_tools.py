"""pipeckpt._compat's changes to torch's memory tools (torch_private.py ``MemTracker`` and
``FakeTensorMode``) change how fast a profile runs, never what it counts: compared here with
torch's own classes on the same work."""

from typing import Any, Dict, List, Tuple

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode as TorchFakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker as TorchMemTracker

from pipeckpt import _compat


def _nested() -> nn.Module:
    block = lambda: nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))  # noqa: E731
    return nn.Sequential(block(), nn.Sequential(block(), block()), nn.LayerNorm(16))


def _tracked(tracker_type: Any, model: nn.Module, x: torch.Tensor, later: nn.Module) -> Tuple[Any, ...]:
    """Every module's snapshots and the peak after two steps, the stats reset between them (as
    MemTracker asks) and ``later`` (a module never seen by the tracker before) joining in the second."""
    with tracker_type() as tracker:
        model(x).sum().backward()
        tracker.reset_mod_stats()
        later(model(x)).sum().backward()
    per_module: Dict[str, Any] = {
        s.mod_fqn: (s.snapshots, s.local_peak) for s in tracker.memory_tracking.values()
    }
    return per_module, tracker.get_tracker_snapshot("peak")


def test_memtracker_records_every_modules_snapshots_and_the_peak_as_torchs_does():
    torch.manual_seed(0)
    model, later, x = _nested(), nn.Linear(16, 16), torch.randn(8, 16)
    mine = _tracked(_compat.MemTracker, model, x, later)
    model.zero_grad(set_to_none=True)
    later.zero_grad(set_to_none=True)
    theirs = _tracked(TorchMemTracker, model, x, later)
    assert len(mine[0]) == 16  # the model, its 14 submodules and the later Linear
    assert mine == theirs


def _fake_counts(cache: bool) -> List[Dict[str, int]]:
    """Each layer's tracked bytes at every state, a small GPT-like stack run on fake tensors."""
    with _compat.FakeTensorMode(allow_non_fake_inputs=True) as mode:
        mode.cache_enabled = cache
        torch.manual_seed(0)
        layers = nn.Sequential(*(nn.TransformerEncoderLayer(32, 4, 64, batch_first=True) for _ in range(3)))
        x = torch.randn(4, 16, 32)
        with _compat.MemTracker() as tracker:
            layers(x).sum().backward()
    return [_compat.module_memory(tracker, layer) for layer in layers]


def test_fake_tensors_dispatch_cache_changes_no_count():
    # the cache answers the second and third layers' ops: they are counted as the first's, and as
    # without it
    assert _fake_counts(cache=True) == _fake_counts(cache=False)


def test_a_fake_mode_starts_from_an_empty_dispatch_cache():
    # the cache is the process's: what a profile counts cannot depend on what ran before it
    with TorchFakeTensorMode() as mode:
        mode.cache_enabled = True
        nn.Linear(8, 8)(torch.randn(2, 8))
    assert len(TorchFakeTensorMode.cache) > 0
    with _compat.FakeTensorMode() as mine:
        assert mine.cache_enabled and len(TorchFakeTensorMode.cache) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_grouped_matrix_product_of_other_dtypes_runs_on_fake_tensors_as_on_real_ones(dtype):
    # torch's meta kernel checks the fast kernel's bfloat16 only; HF's MoE experts call it in float32
    def run() -> Tuple[torch.Tensor, ...]:
        torch.manual_seed(0)
        tokens = torch.randn(6, 8, dtype=dtype, requires_grad=True)  # grouped by offs: 2, 1 and 3 rows
        experts = torch.randn(3, 8, 8, dtype=dtype, requires_grad=True)
        out = torch.nn.functional.grouped_mm(tokens, experts, offs=torch.tensor([2, 3, 6], dtype=torch.int32))
        batched = torch.nn.functional.grouped_mm(experts.transpose(1, 2), experts)  # 3D x 3D
        (out.square().sum() + batched.square().sum()).backward()  # gradients with real strides
        return out, batched, tokens.grad, experts.grad

    real = run()
    with _compat.FakeTensorMode():
        fake = run()
    for f, r in zip(fake, real, strict=True):
        assert type(f).__name__ == "FakeTensor"
        assert (f.shape, f.stride(), f.dtype) == (r.shape, r.stride(), r.dtype)
