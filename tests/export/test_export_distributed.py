"""The export to Hugging Face under the distributed engine: tiny random GPT-2 (tied), Llama and PEFT
LoRA on the Llama trained 3 steps in 2 pipeline processes, and in 2 pipeline stages x 2 replicas (DDP
for GPT-2, FSDP2 for the others; gloo on CPU, tests/export/export_worker.py), with ``HFExport``
writing the export when ``fit`` ends. ``from_pretrained`` (``PeftModel.from_pretrained`` for LoRA)
loads exactly the weights of the run's sharded checkpoint; an export from that checkpoint reads one
shard's keys at a time.

Under pp2 x tp2 (data_parallel='fsdp' with dp=1, 4 processes) a Llama filled from a bf16 pretrained
directory through ``pipeline_of`` is split by its config's own plan: after 3 steps the export
``HFExport`` wrote, and the one ``python -m pipeckpt.export`` makes of the run's checkpoint (both
keeping the trained float32: ``dtype='checkpoint'``), load with ``from_pretrained`` bitwise equal
to the whole weights the processes gathered from their DTensors (``full_tensor``), with bitwise
equal logits. ``checkpoint='auto'`` chose the run's modes
counting each rank's parameters by that plan. The same again with sequence parallelism
(``sequence_parallel=True``: each norm a replicated DTensor, saved and exported whole)."""

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, List

import pytest
import support.ranks as ranks
import torch

pytest.importorskip("peft")
import transformers
from peft import PeftModel
from support.hf_models import batches
from support.pretrained_models import save
from test_tp_pipeline_of import LLAMA_PLAN

from pipeckpt.export import export_hf
from pipeckpt.export import source as export_source
from pipeckpt.state import sharded

WORKER = Path(__file__).resolve().parent / "export_worker.py"
START_S = 480
SMALL_SHARD = 20_000  # bytes: the tiny models' ~100 KiB in several shards
PP2 = dict(balance=[2, 2], chunks=2, schedule="1f1b")
DDP2 = dict(PP2, dp=2)
FSDP2 = dict(PP2, dp=2, data_parallel="fsdp")
# the plan: the Llama config's own; checkpoint='auto' counts each rank's share by it
TP2 = dict(PP2, tensor_parallel=2, data_parallel="fsdp", checkpoint="auto", memory_budget="4GiB")
# dtype 'checkpoint': the export keeps the trained float32, not the pretrained directory's bf16
TP_RUN: Dict[str, Any] = dict(name="llama_pp2_tp2", model="llama", world=4, strategy=TP2, dtype="checkpoint")
RUNS: List[Dict[str, Any]] = [
    dict(name="gpt2_pp2", model="gpt2", world=2, strategy=PP2),
    dict(name="llama_pp2", model="llama", world=2, strategy=PP2),
    dict(name="lora_pp2", model="lora", world=2, strategy=PP2),
    dict(
        name="refused_pp2", model="gpt2", world=2, strategy=PP2, fails=True
    ),  # last: it ends its ranks' group
    dict(name="gpt2_pp2_ddp2", model="gpt2", world=4, strategy=DDP2),
    dict(name="llama_pp2_fsdp2", model="llama", world=4, strategy=FSDP2),
    dict(name="lora_pp2_fsdp2", model="lora", world=4, strategy=FSDP2),
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Iterator[Path]:
    out = tmp_path_factory.mktemp("export")
    for world in (2, 4):
        mine = [dict(r, steps=3, max_shard_size=SMALL_SHARD) for r in RUNS if r["world"] == world]
        (out / f"world{world}").mkdir()
        ranks.launch(WORKER, world, mine, out / f"world{world}", within_s=START_S)
    yield out


def _checkpoint(runs: Path, run: Dict[str, Any]) -> Path:
    return runs / f"world{run['world']}" / f"{run['name']}.ckpt"


def _trained(runs: Path, run: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    """The run's weights as its sharded checkpoint holds them, under the HF model's own keys."""
    state = sharded.load(_checkpoint(runs, run), weights_only=True)["state_dict"]
    return {k.removeprefix("model."): v for k, v in state.items()}


@pytest.mark.slow
@pytest.mark.parametrize(
    "run", [r for r in RUNS if r["model"] != "lora" and not r.get("fails")], ids=lambda r: r["name"]
)
def test_from_pretrained_loads_the_runs_weights_exactly_and_gives_equal_logits(runs, run):
    export = _checkpoint(runs, run).with_name(f"{run['name']}-hf")
    assert json.loads((export / "model.safetensors.index.json").read_text())["weight_map"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(export)
    want = _trained(runs, run)
    got = loaded.state_dict()
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    reference = type(loaded)(loaded.config)
    reference.load_state_dict(want)
    ids = batches(1)[0]["input_ids"]
    with torch.no_grad():
        assert torch.equal(loaded.eval()(ids).logits, reference.eval()(ids).logits)


@pytest.mark.slow
@pytest.mark.parametrize("run", [r for r in RUNS if r["model"] == "lora"], ids=lambda r: r["name"])
def test_lora_adapters_load_with_peft_and_equal_the_runs_adapters(runs, run):
    export = _checkpoint(runs, run).with_name(f"{run['name']}-hf")
    trained = _trained(runs, run)
    want = {k: v for k, v in trained.items() if "lora_" in k}
    loaded = PeftModel.from_pretrained(transformers.LlamaForCausalLM(_llama_config()), export)
    loaded.load_state_dict({k: v for k, v in trained.items() if k not in want}, strict=False)  # the base
    got = loaded.state_dict()
    assert want and all(torch.equal(got[k], v) for k, v in want.items())
    assert any(v.abs().sum() > 0 for k, v in want.items() if "lora_B" in k)  # trained: B starts at 0


def _llama_config() -> Any:
    from support.frozen_models import LoraLlama

    return LoraLlama().model.get_base_model().config


@pytest.mark.slow
def test_an_export_of_a_sharded_checkpoint_reads_one_shards_keys_at_a_time(
    runs, tmp_path, monkeypatch, source_reads
):
    run = RUNS[1]
    reads = source_reads
    loaded_calls: List[List[str]] = []
    load = sharded.load
    monkeypatch.setattr(
        export_source.sharded,
        "load",
        lambda path, keys=None, **kw: loaded_calls.append(keys) or load(path, keys=keys, **kw),
    )
    hf_config = transformers.AutoConfig.from_pretrained(_checkpoint(runs, run).with_name(f"{run['name']}-hf"))
    out = export_hf(
        _checkpoint(runs, run), tmp_path / "hf", prefix="model.", config=hf_config, max_shard_size=SMALL_SHARD
    )
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(reads) == len(set(index.values())) > 2
    assert all(keys is not None for keys in loaded_calls) and len(loaded_calls) == len(reads)
    for keys in reads:
        assert len({index[k.removeprefix("model.")] for k in keys}) == 1


@pytest.mark.slow
def test_an_export_refused_on_rank_0_is_raised_on_every_rank_and_nothing_is_replaced(runs):
    where = runs / "world2"  # rank 0 put a file of the user's in the export directory at the end
    errors = [(where / f"refused_pp2.rank{rank}.error").read_text() for rank in (0, 1)]
    assert "notes.txt" in errors[0] and "replaces its directory whole" in errors[0]
    assert "global rank 0 could not export" in errors[1] and "notes.txt" in errors[1]
    assert [p.name for p in (where / "refused_pp2-hf").iterdir()] == ["notes.txt"]
    assert not [p.name for p in where.iterdir() if p.name.startswith(".pipeckpt-")]  # no staged weights left


# -- pp2 x tp2 ----------------------------------------------------------------------------


@pytest.fixture(scope="module", params=[False, True], ids=["tp", "sequence_parallel"])
def tp_run(request: pytest.FixtureRequest, tmp_path_factory) -> Iterator[Path]:
    """The pp2 x tp2 run, and the same with sequence parallelism (its norms replicated DTensors)."""
    out = tmp_path_factory.mktemp("export_tp")
    path = str(save("llama", out / "pretrained"))
    strategy = dict(TP2, sequence_parallel=True) if request.param else TP2
    run = dict(TP_RUN, strategy=strategy, steps=3, max_shard_size=SMALL_SHARD, path=path)
    ranks.launch(WORKER, 4, [run], out, within_s=START_S)
    yield out


def _gathered(out: Path) -> Dict[str, torch.Tensor]:
    """The trained weights as the 4 processes hold them, each DTensor gathered whole."""
    merged: Dict[str, torch.Tensor] = {}
    for rank in range(4):
        for key, value in torch.load(out / f"{TP_RUN['name']}.trained{rank}.pt", weights_only=True).items():
            assert key not in merged or torch.equal(merged[key], value), key  # the copies agree
            merged[key] = value
    return merged


def _loads_the_gathered_weights_with_equal_logits(export: Path, gathered: Dict[str, torch.Tensor]) -> None:
    loaded = transformers.AutoModelForCausalLM.from_pretrained(export)
    got = loaded.state_dict()
    assert sorted(got) == sorted(gathered)
    assert all(torch.equal(got[k], gathered[k]) for k in gathered)
    reference = type(loaded)(loaded.config)
    reference.load_state_dict(gathered)
    ids = batches(1)[0]["input_ids"]
    with torch.no_grad():
        assert torch.equal(loaded.eval()(ids).logits, reference.eval()(ids).logits)


@pytest.mark.slow
def test_hfexport_of_a_pp2_tp2_run_loads_the_weights_its_dtensors_hold_whole(tp_run):
    gathered = _gathered(tp_run)
    projection = gathered["model.layers.3.self_attn.q_proj.weight"]
    assert projection.shape == (32, 32)  # whole, not one tensor-parallel rank's half
    _loads_the_gathered_weights_with_equal_logits(tp_run / f"{TP_RUN['name']}-hf", gathered)


@pytest.mark.slow
def test_the_export_command_of_a_pp2_tp2_runs_checkpoint_loads_the_weights_its_dtensors_hold_whole(tp_run):
    checkpoint, export = tp_run / f"{TP_RUN['name']}.ckpt", tp_run / "command-hf"
    argv = [str(checkpoint), str(export), "--prefix", "model.", "--config", str(tp_run / "pretrained"),
            "--dtype", "checkpoint"]  # fmt: skip
    subprocess.run([sys.executable, "-m", "pipeckpt.export", *argv], check=True, timeout=300)
    _loads_the_gathered_weights_with_equal_logits(export, _gathered(tp_run))


@pytest.mark.slow
def test_auto_in_a_pp2_tp2_run_counts_each_ranks_share_by_the_models_own_plan(tp_run):
    # the layers' entries and, by transformers' own plan, the embedding and head over the vocabulary
    counted = json.loads((tp_run / f"{TP_RUN['name']}.counted.json").read_text())
    assert counted == {**LLAMA_PLAN, "model.embed_tokens": "rowwise", "lm_head": "colwise"}
