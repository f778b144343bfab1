"""``python train.py model=hf model.path=DIR strategy.engine=distributed trainer.devices=2`` on a directory
whose weights do not fit its config.json is refused by the launching process before the other
process starts (issue 45, item 1): the checks run on the index and the shards' headers in
``check_config`` (a key lacking, a shape unlike the module's) or when the model is built (a key no
tensor takes), both before ``fit`` launches rank 1. One line, said once, exit status 1, no
traceback. Rank 1, had it started, would have run under the Hydra job name Lightning gives it
(``train_ddp_process_1``, whose log file Hydra writes in the run directory) and said
``GLOBAL_RANK: 1`` as it joined."""

import json
import shutil
from pathlib import Path

import pytest
from test_hf_pretrained_dirs import run

from pipeckpt.app.tiny_pretrained import make_tiny_pretrained

DISTRIBUTED = ["strategy.engine=distributed", "trainer.devices=2"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_pretrained(tmp_path_factory.mktemp("hf") / "tiny-llama", "llama")


def _with_config(tiny: Path, where: Path, **fields) -> Path:
    path = Path(shutil.copytree(tiny, where))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **fields}))
    return path


@pytest.mark.slow
@pytest.mark.parametrize(
    "fields, said",
    [
        ({"num_hidden_layers": 6}, "lacks model.layers.4."),
        ({"intermediate_size": 256}, "has shape (128, 64), the module's (256, 64)"),
        ({"num_hidden_layers": 2}, "holds 18 key(s) no tensor of LlamaForCausalLM takes"),
    ],
    ids=["key-lacking", "wrong-shape", "key-left-over"],
)
def test_weights_unlike_the_config_are_refused_once_before_rank_one_starts(tmp_path, tiny, fields, said):
    path = _with_config(tiny, tmp_path / "damaged", **fields)
    out = tmp_path / "run"
    done = run(out, "model=hf", f"model.path={path}", *DISTRIBUTED)
    assert done.returncode == 1, done.stderr[-3000:]
    output = done.stdout + done.stderr
    assert "Traceback" not in output, output[-3000:]
    refusals = [line for line in done.stderr.splitlines() if line.startswith("Configuration error: ")]
    assert len(refusals) == 1 and said in refusals[0], done.stderr[-3000:]
    assert f"HINT: the weights in model.path={path} and its config.json disagree" in refusals[0]
    assert "GLOBAL_RANK: 1" not in output
    assert not (out / "train_ddp_process_1.log").exists()
