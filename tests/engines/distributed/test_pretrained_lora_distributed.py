"""PEFT LoRA on a tiny Llama built on the meta device and filled from a pretrained directory (bf16
shards), trained 3 steps as pp2 x fsdp2 (4 gloo processes, tests/engines/distributed/
pretrained_lora_worker.py): each process makes its own stage real, its base tensors read from the
directory and its adapters initialised by PEFT (none reported missing); the base starts bitwise at
``from_pretrained(dir, dtype=float32)`` and does not move, every LoRA B starts at zero and trains, and
the adapters ``HFExport`` wrote load with ``PeftModel.from_pretrained`` equal to the run's sharded
checkpoint's."""

from pathlib import Path
from typing import Any, Dict, Iterator, List

import pytest
import support.ranks as ranks
import torch

pytest.importorskip("peft")
from peft import PeftModel
from support.pretrained_lora import base_key, is_adapter
from support.pretrained_models import reference, save

from pipeckpt.state import sharded

HERE = Path(__file__).resolve().parent
WORKER = HERE / "pretrained_lora_worker.py"
START_S = 480  # one fit of 4 processes on a loaded 2-core machine
WORLD = 4
FSDP2 = dict(balance=[2, 2], chunks=2, schedule="gpipe", dp=2, data_parallel="fsdp")


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> Iterator[Path]:
    out = tmp_path_factory.mktemp("lora_pp2_fsdp2")
    path = save("llama", out / "llama")
    runs = [dict(name="lora", path=str(path), strategy=FSDP2)]
    yield ranks.launch(WORKER, WORLD, runs, out, within_s=START_S)


def _ranks(out: Path) -> List[Dict[str, Any]]:
    return [torch.load(out / f"lora_rank{r}.pt", weights_only=True) for r in range(WORLD)]


def _whole(out: Path, when: str) -> Dict[str, torch.Tensor]:
    """Every tensor some rank held for real, at fit start or after training (replicas agree)."""
    whole: Dict[str, torch.Tensor] = {}
    for saved in _ranks(out):
        for k, v in saved[when].items():
            assert k not in whole or torch.equal(whole[k], v), k
            whole[k] = v
    return whole


@pytest.mark.slow
def test_the_base_starts_bitwise_at_from_pretrained_and_every_lora_b_at_zero(launched):
    at_start = _whole(launched, "at_start")
    want = reference(launched / "llama").state_dict()
    base = {base_key(k): v for k, v in at_start.items() if not is_adapter(k)}
    assert base.keys() == want.keys()
    assert all(torch.equal(v, want[k]) for k, v in base.items())
    lora_b = [v for k, v in at_start.items() if ".lora_B." in k]
    assert len(lora_b) == 8 and all(not v.any() for v in lora_b)


@pytest.mark.slow
def test_three_steps_change_the_adapters_only(launched):
    at_start, trained = _whole(launched, "at_start"), _whole(launched, "trained")
    assert trained.keys() == at_start.keys()
    assert all(torch.equal(trained[k], v) for k, v in at_start.items() if not is_adapter(k))
    assert all(not torch.equal(trained[k], v) for k, v in at_start.items() if ".lora_B." in k)


@pytest.mark.slow
def test_the_exported_adapters_load_with_peft_equal_to_the_checkpoints(launched):
    state = sharded.load(launched / "lora.ckpt", weights_only=True)["state_dict"]
    adapters = {k.removeprefix("model."): v for k, v in state.items() if is_adapter(k)}
    loaded = PeftModel.from_pretrained(reference(launched / "llama"), launched / "lora-hf").state_dict()
    assert len(adapters) == 16 and all(torch.equal(loaded[k], v) for k, v in adapters.items())
    assert adapters.keys() == {k for k in _whole(launched, "trained") if is_adapter(k)}
