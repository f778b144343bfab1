"""``python train.py model=hf data=dataset`` as a user runs it (a process of its own): a chat JSONL,
a prompt/response JSONL and a Parquet text file train; a packed, masked chat run pipelined under the
local and the distributed engine ends with the parameters of one process (float tolerance)."""

from pathlib import Path
from typing import Dict

import datasets
import pytest
import torch
from test_dataset_rows import chats, write_rows
from test_train_e2e import train

from pipeckpt import convert
from pipeckpt.app.tiny_pretrained import make_tiny_pretrained


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_pretrained(tmp_path_factory.mktemp("hf") / "tiny-llama", "llama")


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch) -> None:
    """The runs' datasets cache in this test's folder (the spawned process reads the variable)."""
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))


def run(out: Path, tiny: Path, *overrides: str) -> str:
    done = train(out, "model=hf", f"model.path={tiny}", "data=dataset", "trainer.max_steps=4", *overrides)
    return done.stdout


def final_parameters(out: Path) -> Dict[str, torch.Tensor]:
    """The run's last.ckpt's weights; a distributed run's sharded directory converted first, as a user
    does (python -m pipeckpt.convert)."""
    last = out / "checkpoints" / "last.ckpt"
    if last.is_dir():
        convert.main([str(last), str(out / "whole.ckpt")])
        last = out / "whole.ckpt"
    return torch.load(last, map_location="cpu", weights_only=True)["state_dict"]


def test_a_chat_jsonl_trains_with_the_chatml_template(tmp_path, tiny):
    path = write_rows(tmp_path / "chat.jsonl", chats(200))
    out = run(tmp_path / "run", tiny, f"data.path={path}", "data.format=chat", "data.chat_template=chatml")
    assert "4 steps in" in out.splitlines()[-1] and " tokens/s (" in out.splitlines()[-1]


def test_a_prompt_response_jsonl_trains(tmp_path, tiny):
    rows = [{"prompt": f"Q{i}: the cat sat?\nA:", "response": f" on mat {i % 7}"} for i in range(200)]
    path = write_rows(tmp_path / "pairs.jsonl", rows)
    out = run(tmp_path / "run", tiny, f"data.path={path}", "data.format=prompt_response")
    assert "4 steps in" in out.splitlines()[-1]


def test_a_parquet_text_file_trains_packed(tmp_path, tiny):
    rows = [{"text": f"row {i}: " + "the cat sat on the mat " * (1 + i % 5)} for i in range(200)]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "text.parquet"))
    out = run(
        tmp_path / "run",
        tiny,
        f"data.path={tmp_path / 'text.parquet'}",
        "data.format=text",
        "data.packing=true",
        "data.val_fraction=0.25",
    )
    assert "4 steps in" in out.splitlines()[-1]


PACKED_CHAT = ["data.format=chat", "data.chat_template=chatml", "data.packing=true", "data.val_fraction=0.25"]


@pytest.mark.slow
def test_a_packed_masked_chat_pipelined_under_both_engines_equals_one_process(tmp_path, tiny):
    path = write_rows(tmp_path / "chat.jsonl", chats(200))
    common = [f"data.path={path}", *PACKED_CHAT]
    run(tmp_path / "single", tiny, *common, "strategy=single")
    run(tmp_path / "local", tiny, *common, "strategy.stages=2", "strategy.chunks=4")
    run(tmp_path / "distributed", tiny, *common, "strategy.engine=distributed", "trainer.devices=2")
    want = final_parameters(tmp_path / "single")
    for engine in ("local", "distributed"):
        got = final_parameters(tmp_path / engine)
        assert got.keys() == want.keys()
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6, msg=f"{engine}: {key}")
