"""What a process allocates and keeps resident while it makes its stages real from the meta device.

Allocated: its own stages' tensors, the scratch it draws other stages' initial values into (a
process replays the draws before its own layers, one layer at a time), and bookkeeping (the
generators' states it exchanges), nothing else. A per-layer temporary the size of the layer's
elements (a NaN mask of each tensor, freed at once) was enough for glibc's heap to keep up to 208 MiB
more than a process's half of 24 Linear(4096, 4096) at train start; freed memory glibc keeps shows in
no tensor count, so this counts every storage an operator creates from ``trainer.fit`` to train
start. Resident: filling a model from a pretrained directory, a process maps the checkpoint's files
(safetensors), and the pages it reads count as its resident memory while a file is open: at most one
tensor's at a time. One launch of 2 real processes (gloo on CPU, setup_allocations_worker.py beside
this file): 6 Linear(256, 256) built in ``configure_model``, pp2, balance 3 + 3; then a Llama saved
in bf16 in one file, pp2."""

from pathlib import Path
from typing import Any, Dict

import pytest
import support.ranks as ranks
import torch
import transformers
from setup_allocations_worker import WIDTH

HERE = Path(__file__).resolve().parent
WORLD, BALANCE = 2, [3, 3]
LAYER_BYTES = (WIDTH * WIDTH + WIDTH) * 4  # one Linear's float32 weight and bias
# The generators' states (5 KiB each) that the processes exchange as pickles: rank 0's plan and
# seed, and every process's states past the initial draws. A NaN mask of one layer's weight (a
# quarter of its bytes, 64 KiB) is over it.
BOOKKEEPING = 48 * 1024
LLAMA = dict(
    vocab_size=16000, hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=8, max_position_embeddings=32, use_cache=False, bos_token_id=0, eos_token_id=0,
)  # fmt: skip
LARGEST_BF16 = 16000 * 512 * 2  # the embedding's (and the head's) bytes in the file
# What else a process's peak at set-up may hold beyond what it keeps: interpreter and allocator
# noise. Each rank reads 2.6x the largest tensor (the embedding, the head and 2 layers).
NOISE = 8 * 2**20


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("setup_allocations")
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).to(torch.bfloat16)
    llama.save_pretrained(out / "llama", max_shard_size="1GB")
    del llama
    runs = [dict(case="linears", balance=BALANCE), dict(case="pretrained", path=str(out / "llama"))]
    return ranks.launch(HERE / "setup_allocations_worker.py", WORLD, runs, out, within_s=300)


def _result(out: Path, case: str, rank: int) -> Dict[str, Any]:
    return torch.load(out / f"{case}_rank{rank}.pt", weights_only=True)


@pytest.mark.slow
def test_set_up_allocates_only_held_tensors_replay_scratch_and_bookkeeping(two_processes: Path) -> None:
    for rank in range(WORLD):
        created = _result(two_processes, "linears", rank)["created"]
        held = sum(c["bytes"] for c in created if c["held"])
        assert held == BALANCE[rank] * LAYER_BYTES, created
        scratch = sum(BALANCE[:rank]) * LAYER_BYTES  # the earlier stages' layers, drawn and dropped
        freed = sum(c["bytes"] for c in created if not c["held"])
        assert scratch <= freed <= scratch + BOOKKEEPING, [c for c in created if not c["held"]]


@pytest.mark.slow
def test_filling_from_a_pretrained_file_keeps_at_most_one_tensor_of_it_resident(two_processes: Path) -> None:
    assert len(list((two_processes / "llama").glob("*.safetensors"))) == 1
    for rank in range(WORLD):
        resident = _result(two_processes, "pretrained", rank)
        assert resident["VmHWM"] - resident["VmRSS"] <= LARGEST_BF16 + NOISE, resident
