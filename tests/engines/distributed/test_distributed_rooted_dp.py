"""``pipeline_of`` under the distributed engine with data-parallel replicas (dp > 1). One launch of 4
real processes (2 pipeline stages x 2 replicas, gloo on CPU,
tests/engines/distributed/distributed_rooted_dp_worker.py) trains Hugging Face GPT-2 twice (once
plain, once clipped by norm). Its tied input embedding / LM head is held by both stages of a
replica, 4 copies in all; the learned positions by the first stage, the final norm by the last (the
stages that read them). Replica r reads samples r, r + 2, ... in order; in the first run the ranks
of replica 1 start from other weights (``skew``), so only a broadcast from replica 0 makes the
replicas train alike. Each run is compared with the unmodified model trained in this process on the
same global batches (16 samples, both replicas' 8 together): last step's gradients and trained
weights within 1e-5 relative, every copy of a tensor bitwise equal on every rank that holds it, the
checkpoint written by replica 0 only and loading strict=True into the unmodified model. Dropout is
off: each replica draws its own masks, which no single process reproduces."""

import functools
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import pytest
import support.ranks as ranks
import torch
from support.real_models import client
from support.toy import assert_bitwise_equal, max_relative_difference
from test_distributed_pytree import _state
from torch.utils.data import DataLoader

from pipeckpt.engines.distributed import ties

HERE = Path(__file__).resolve().parent
WORKER = HERE / "distributed_rooted_dp_worker.py"
WORLD, PP, DP = 4, 2, 2
STEPS = 2
START_S = 300  # 4 processes on a loaded 2-core machine
RUN = dict(
    name="gpt2_dp2_1f1b_always",
    client="gpt2",
    strategy=dict(balance=[2, 2], chunks=4, schedule="1f1b", checkpoint="always", dp=DP),
    steps=STEPS,
    skew=True,
)
CLIP = 0.05  # by norm: the norm of the replica-averaged gradients, a tie counted once
CLIPPED = dict(
    name="gpt2_dp2_gpipe_except_last_clip",
    client="gpt2",
    strategy=dict(balance=[2, 2], chunks=4, schedule="gpipe", checkpoint="except_last", dp=DP),
    steps=STEPS,
    gradient_clip_val=CLIP,
)
# The parameters outside the named layers, by the stages that read them: the tied embedding and head
# both, the learned positions the first, the final norm the last.
OUTSIDE = {
    "model.transformer.wte.weight": (0, 1),
    "model.transformer.wpe.weight": (0,),
    "model.transformer.ln_f.weight": (1,),
}


def test_gradients_are_averaged_in_order_in_buckets_of_one_dtype_within_the_byte_cap(monkeypatch):
    monkeypatch.setattr(ties, "_BUCKET_BYTES", 64)  # 16 float32 elements
    grads = [
        torch.zeros(8),
        torch.zeros(8),
        torch.zeros(4),
        torch.zeros(2, dtype=torch.float64),
        torch.zeros(40),
        torch.zeros(2),
    ]
    cut = [[g.numel() for g in bucket] for bucket in ties._buckets(grads)]
    assert cut == [[8, 8], [4], [2], [40], [2]]  # full; a dtype change; one tensor over the cap alone


@pytest.fixture(scope="module")
def four_processes(tmp_path_factory) -> Iterator[Path]:
    runs: List[Dict[str, Any]] = [RUN, CLIPPED]
    yield ranks.launch(WORKER, WORLD, runs, tmp_path_factory.mktemp("rooted_dp"), within_s=START_S)


@functools.cache
def _reference(clip: Optional[float] = None) -> Dict[str, Dict[str, torch.Tensor]]:
    """The unmodified model trained in one process on the replicas' batches joined."""
    module, loader = client("gpt2")
    torch.manual_seed(123)
    trainer = ranks.quiet_trainer("auto", 1, max_steps=STEPS, gradient_clip_val=clip)
    trainer.fit(module, DataLoader(loader.dataset, batch_size=DP * loader.batch_size))
    return {
        "weights": {k: v.detach().clone() for k, v in module.state_dict().items()},
        "grads": {f"model.{n}": p.grad.clone() for n, p in module.model.named_parameters()},
    }


def _rank(out: Path, rank: int) -> Dict[str, Dict[str, torch.Tensor]]:
    return torch.load(out / f"{RUN['name']}.rank{rank}.pt", weights_only=True)


@pytest.fixture(scope="module")
def reference() -> Dict[str, Dict[str, torch.Tensor]]:
    return _reference()


@pytest.mark.slow
@pytest.mark.parametrize("run", [RUN, CLIPPED], ids=lambda r: r["name"])
def test_trained_weights_equal_one_process_trained_on_both_replicas_batches(four_processes, run):
    got = _state(four_processes / f"{run['name']}.ckpt")["state_dict"]
    expected = _reference(run.get("gradient_clip_val"))["weights"]
    assert sorted(got) == sorted(expected)  # the model's own keys, each once
    assert max_relative_difference(got, expected) < 1e-5


@pytest.mark.slow
def test_each_ranks_last_gradients_equal_one_process_on_both_replicas_batches(four_processes, reference):
    for rank in range(WORLD):
        grads = _rank(four_processes, rank)["grads"]
        assert grads, f"rank {rank} holds no gradient"
        expected = {k: reference["grads"][k] for k in grads}
        assert max_relative_difference(grads, expected) < 1e-5, f"rank {rank}"


@pytest.mark.slow
def test_every_copy_of_a_tensor_is_bitwise_equal_on_every_rank_that_holds_it(four_processes):
    held = [_rank(four_processes, r)["held"] for r in range(WORLD)]
    grads = [_rank(four_processes, r)["grads"] for r in range(WORLD)]
    for r in range(PP):  # the same pipeline rank in both replicas: everything it holds
        assert_bitwise_equal(held[r], held[r + PP])
        assert_bitwise_equal(grads[r], grads[r + PP])
    for key, stages in OUTSIDE.items():  # outside the named layers: held by the stages that read it
        holders = [r for r in range(WORLD) if key in held[r]]
        assert holders == [r for r in range(WORLD) if r % PP in stages], key
        for r in holders:
            assert torch.equal(held[r][key], held[holders[0]][key]), f"{key} on rank {r}"


@pytest.mark.slow
def test_replica_0_alone_writes_the_checkpoint_which_loads_strictly_into_the_unmodified_model(four_processes):
    path = four_processes / f"{RUN['name']}.ckpt"
    written = sorted(f.name for f in path.glob("*.distcp") if f.stat().st_size > 0)
    assert written and all(name.startswith(("__0_", "__1_")) for name in written), written
    state = _state(path)["state_dict"]
    plain = client("gpt2")[0].model
    plain.load_state_dict({k.removeprefix("model."): v for k, v in state.items()}, strict=True)
    assert plain.lm_head.weight is plain.transformer.wte.weight  # the tie survives
