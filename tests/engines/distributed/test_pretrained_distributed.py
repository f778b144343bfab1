"""Fine-tuning from a pretrained directory under the distributed engine: real processes (gloo on CPU,
tests/engines/distributed/pretrained_worker.py) train tiny HF Llama and GPT-2 (tied) saved in bf16
in 17-18 safetensors shards, 3 steps as pp2 (2 processes) and Llama as pp2 x fsdp2 (4 processes),
built on the meta device and filled from the directory (pipeckpt.pretrained), and, for reference,
from_pretrained in every process. Each rank reads exactly the keys of its own tensors (its stage's
layers and, of what lies outside the layers, what its stage reads: the embedding on the first, the
final norm and head on the last; under FSDP only the slices its shards hold), starts bitwise at
from_pretrained(dir, dtype=float32) on them, and trains within 1e-5 of the eagerly-built run."""

from pathlib import Path
from typing import Any, Dict, Iterator

import pytest
import support.ranks as ranks
import torch
from support.pretrained_models import LAYERS, FromScratch, reference, save
from support.toy import assert_bitwise_equal, max_relative_difference

HERE = Path(__file__).resolve().parent
WORKER = HERE / "pretrained_worker.py"
START_S = 480  # 4 short fits of 2 processes, or 2 of 4, on a loaded 2-core machine
BALANCE = [2, 2]
PP2 = dict(balance=BALANCE, chunks=2, schedule="gpipe")
LAYOUTS = {  # name: processes, settings, models
    "pp2": (2, PP2, ("llama", "gpt2")),
    "pp2_fsdp2": (4, dict(PP2, dp=2, data_parallel="fsdp"), ("llama",)),
}
SCRATCH = ("llama", "qwen2")  # pretraining from the config's own initialisation, pp2


@pytest.fixture(scope="module", params=list(LAYOUTS))
def launched(request, tmp_path_factory) -> Iterator[Any]:
    world, settings, models = LAYOUTS[request.param]
    out = tmp_path_factory.mktemp(request.param)
    paths = {model: str(save(model, out / model)) for model in models}
    runs = [
        dict(name=f"{model}_{build}", model=model, build=build, path=paths[model], strategy=settings)
        for model in models
        for build in ("meta", "eager")
    ]
    if request.param == "pp2":
        runs += [
            dict(name=f"{model}_scratch_{build}", model=model, build=build, scratch=True, strategy=settings)
            for model in SCRATCH
            for build in ("meta", "eager")
        ]
    yield request.param, world, ranks.launch(WORKER, world, runs, out, within_s=START_S)


def _saved(out: Path, run: str, rank: int) -> Dict[str, Any]:
    return torch.load(out / f"{run}_rank{rank}.pt", weights_only=True)


# Outside the layers, by model: the stages that read each tensor (the embedding the first, the
# final norm and the head the last, GPT-2's head tied to its embedding both), and so hold it.
OUTSIDE = {
    "llama": {"model.embed_tokens.weight": (0,), "model.norm.weight": (1,), "lm_head.weight": (1,)},
    "qwen2": {"model.embed_tokens.weight": (0,), "model.norm.weight": (1,), "lm_head.weight": (1,)},
    "gpt2": {
        "transformer.wte.weight": (0, 1),
        "lm_head.weight": (0, 1),
        "transformer.wpe.weight": (0,),
        "transformer.ln_f.weight": (1,),
        "transformer.ln_f.bias": (1,),
    },
}


def _own_keys(out: Path, model: str, stage: int, *, scratch: bool = False) -> set:
    """The checkpoint's keys of the tensors a process of stage ``stage`` holds: its layers, and
    of what lies outside the layers, what its stage reads (``OUTSIDE``)."""
    first, stop = sum(BALANCE[:stage]), sum(BALANCE[: stage + 1])
    prefix = LAYERS[model] + "."
    whole = FromScratch(model, build="eager").model if scratch else reference(out / model)
    keys = set(whole.state_dict())
    outside = {k for k in keys if not k.startswith(prefix)}
    assert outside == set(OUTSIDE[model]), outside
    return {k for k in keys - outside if first <= int(k[len(prefix) :].split(".")[0]) < stop} | {
        k for k in outside if stage in OUTSIDE[model][k]
    }


def _legs(launched: Any) -> Iterator[Any]:
    """(model, rank, the rank's saved run built on meta, its stage's own keys) of every leg launched."""
    layout, world, out = launched
    for model in LAYOUTS[layout][2]:
        for rank in range(world):
            saved = _saved(out, f"{model}_meta", rank)
            (stage,) = saved["stages"]
            yield model, rank, out, saved, _own_keys(out, model, stage)


@pytest.mark.slow
def test_each_process_reads_exactly_the_keys_of_its_own_tensors(launched):
    for model, _, _, saved, own in _legs(launched):
        read = saved["read"]
        assert len(read) == len(set(read))  # each once
        tied = {"lm_head.weight"} if model == "gpt2" else set()  # not in the files: tied to the embedding
        assert set(read) == own - tied


@pytest.mark.slow
def test_every_process_starts_bitwise_at_from_pretrained_on_its_own_tensors(launched):
    for model, _, out, saved, own in _legs(launched):
        want = reference(out / model).state_dict()
        held = saved["at_start"]
        assert set(held) == own
        assert_bitwise_equal(held, {k: want[k] for k in held})


@pytest.mark.slow
def test_fine_tuning_matches_the_run_from_pretrained_in_every_process(launched):
    for model, rank, out, saved, _ in _legs(launched):
        eager = _saved(out, f"{model}_eager", rank)["trained"]
        assert max_relative_difference(saved["trained"], eager) <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("model", SCRATCH)
def test_a_model_built_on_meta_from_its_config_starts_bitwise_at_the_eager_build(launched, model):
    layout, world, out = launched
    if layout != "pp2":
        pytest.skip("pretraining from scratch runs under pp2")
    for rank in range(world):
        meta = _saved(out, f"{model}_scratch_meta", rank)
        eager = _saved(out, f"{model}_scratch_eager", rank)
        (stage,) = meta["stages"]
        assert set(meta["at_start"]) == _own_keys(out, model, stage, scratch=True)
        assert_bitwise_equal(meta["at_start"], eager["at_start"])
        assert meta["read"] == []
        assert max_relative_difference(meta["trained"], eager["trained"]) <= 1e-5
