"""``python -m pipeckpt.plan model=hf model.path=DIR``: a Hugging Face model built in ``configure_model``
(on the meta device under the ``pipe`` strategy) is planned under every engine and layout, from a
pretrained directory or from a directory holding config.json alone (issue 43, item 4: the command
ended in ``AssertionError: configure_model runs first``)."""

import os
import sys
from pathlib import Path
from typing import Dict, List

import pytest
import torch
import transformers
from support import forkserver
from torch import nn

from pipeckpt.app.tiny_pretrained import make_tiny_pretrained
from pipeckpt.memory.machine import MARGIN
from pipeckpt.memory.sharding import Layout, rank_state
from pipeckpt.plan import main
from pipeckpt.sizes import MiB, human

pytestmark = pytest.mark.usefixtures("one_thread")

REPO = Path(__file__).resolve().parents[1]
TWO_STAGES = ["model=hf", "strategy.stages=2", "ckpt=always", "data.batch_size=4", "strategy.chunks=2"]
DISTRIBUTED = ["strategy.engine=distributed"]
SHARDED = [*DISTRIBUTED, "trainer.precision=bf16-mixed", "memory.fsdp=2"]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """pipeckpt.app.tiny_pretrained's Llama: 4 layers, width 64, vocabulary 512, untied head."""
    return make_tiny_pretrained(tmp_path_factory.mktemp("hf") / "tiny-llama", "llama")


@pytest.fixture(scope="module")
def config_only(pretrained: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same model's config.json alone, as a transformers config's save_pretrained writes it."""
    directory = tmp_path_factory.mktemp("hf") / "config-only"
    transformers.AutoConfig.from_pretrained(pretrained).save_pretrained(directory)
    return directory


def _rows(out: str) -> List[Dict[str, str]]:
    """The table's rows by column name, through the peak (the first column of that name)."""
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.split()[:3] == ["stage", "layers", "mode"])
    header = lines[at].split()
    header = header[: header.index("peak") + 1]
    return [dict(zip(header, line.split())) for line in lines[at + 1 :] if line.split()[:1] in (["0"], ["1"])]


def _planned(capsys: pytest.CaptureFixture[str], directory: Path, *args: str) -> str:
    assert main([*TWO_STAGES, f"model.path={directory}", *args]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("engine", [[], DISTRIBUTED], ids=["local", "distributed"])
def test_a_pretrained_directory_is_planned_stage_by_stage(
    capsys: pytest.CaptureFixture[str], pretrained: Path, engine: List[str]
) -> None:
    rows = _rows(_planned(capsys, pretrained, *engine))
    assert [(r["stage"], r["layers"], r["mode"]) for r in rows] == [
        ("0", "0-1", "always"),
        ("1", "2-3", "always"),
    ]
    assert all(float(r["peak"]) > float(r["activations"]) > 0 for r in rows)


@pytest.mark.parametrize("engine", [[], DISTRIBUTED], ids=["local", "distributed"])
def test_a_directory_holding_config_json_alone_is_planned_from_it_and_says_so(
    capsys: pytest.CaptureFixture[str], config_only: Path, engine: List[str]
) -> None:
    out = _planned(capsys, config_only, *engine)
    assert f"model.path={config_only}: no weights in the directory, planned from its config.json" in out
    assert [r["layers"] for r in _rows(out)] == ["0-1", "2-3"]


def _layers(directory: Path) -> List[nn.Module]:
    """The model's decoder layers, built on meta from ``directory``."""
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.from_pretrained(directory)
        )
    return list(model.model.layers)


@pytest.mark.parametrize("which", ["pretrained", "config_only"])
def test_under_fsdp_a_rank_holds_a_shard_of_its_layers_and_of_the_parts_only_its_stage_reads(
    capsys: pytest.CaptureFixture[str], request: pytest.FixtureRequest, which: str
) -> None:
    directory = request.getfixturevalue(which)
    out = _planned(capsys, directory, *SHARDED)
    assert "one rank per stage: fsdp 2, tp 1, reshard_after_forward False, bf16-mixed" in out
    layers = _layers(directory)
    layout = Layout(fsdp=2, precision="bf16-mixed")
    shard = [rank_state(layers[:2], layout, "adamw"), rank_state(layers[2:], layout, "adamw")]
    # fp32 master weights, each rank half of them: the embedding (512 x 64) on the first stage, which
    # alone reads it, the final norm (64) and the head (512 x 64) on the last (memory/outside_share.py;
    # the engine shards them with the layers: engines/distributed/outside_parts.py)
    rows = _rows(out)
    assert float(rows[0]["params"]) == round((shard[0].params + 512 * 64 * 4 // 2) / MiB, 2)
    assert float(rows[1]["params"]) == round((shard[1].params + (64 + 512 * 64) * 4 // 2) / MiB, 2)


def test_a_tensor_parallel_degree_splits_the_layers_by_the_models_own_plan(
    capsys: pytest.CaptureFixture[str], pretrained: Path
) -> None:
    out = _planned(capsys, pretrained, *DISTRIBUTED, "trainer.precision=bf16-mixed", "memory.tp=2")
    assert (
        "memory.tp=2: parameters split by the model's own plan (7 entries per layer, and lm_head, "
        "model.embed_tokens over the vocabulary)" in out
    )
    # Per layer on one of 2 ranks: q, o 64x64 and k, v 32x64 halved, gate, up, down 128x64 halved,
    # the two norms (64 each) whole; and the embedding (512 x 64) split over the vocabulary (its
    # rows halved, as the engine splits it: engines/distributed/vocab_plan.py); fp32 master weights.
    per_layer = (2 * 64 * 64 + 2 * 32 * 64 + 3 * 128 * 64) // 2 + 2 * 64
    assert float(_rows(out)[0]["params"]) == round((2 * per_layer + 512 * 64 // 2) * 4 / MiB, 2)


def test_the_default_counts_the_model_configure_model_builds_against_the_memory_available(
    capsys: pytest.CaptureFixture[str], pretrained: Path
) -> None:
    out = _planned(capsys, pretrained, "memory.available=1KiB")
    with torch.device("meta"):  # fp32, as the local engine's table builds it
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.from_pretrained(pretrained), dtype=torch.float32
        )
    state = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    assert (
        f"memory.fake: building on fake tensors (times from FLOPs): the model's {human(state)} of "
        f"parameters and buffers, their gradients and a {human(MARGIN)} margin" in out
    )


def test_the_command_plans_a_config_only_directory_on_fake_tensors(tmp_path: Path, config_only: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    args = [*TWO_STAGES, f"model.path={config_only}", *SHARDED, "memory.fake=true"]
    result = forkserver.run(
        [sys.executable, "-m", "pipeckpt.plan", *args], cwd=tmp_path, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert [r["layers"] for r in _rows(result.stdout)] == ["0-1", "2-3"]


@pytest.fixture(autouse=True)
def _default_dtype_restored() -> None:
    dtype = torch.get_default_dtype()
    yield
    assert torch.get_default_dtype() == dtype
