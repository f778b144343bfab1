"""``python -m pipeckpt.plan model=hf "model.config={...}"`` on fake tensors profiles the model built
again with three of its decoder layers and repeats the middle one (plan_model.three_layers), as the
layout search does: a profile of every layer under torch's MemTracker costs more than linearly in the
layers (minutes for Llama 3.1 70B's 80, over an hour for 405B's 126). The per-rank table must be the
one the whole model's profile gives, to the byte, under every schedule and checkpointing mode."""

import dataclasses
from typing import Dict, List

import pytest
import torch
from omegaconf import DictConfig, OmegaConf

import pipeckpt.plan_ranks
from pipeckpt.boundaries.pipeline_of import pipeline_of
from pipeckpt.plan import run
from pipeckpt.plan_model import three_layers

pytestmark = pytest.mark.usefixtures("one_thread")

CONFIG = (
    "model.config={model_type:llama,hidden_size:64,intermediate_size:176,num_hidden_layers:7,"
    "num_attention_heads:4,num_key_value_heads:2,vocab_size:512,max_position_embeddings:64,"
    "tie_word_embeddings:false}"
)
BASE = [
    "model=hf",
    CONFIG,
    "model.seq_len=32",
    "strategy.engine=distributed",
    "strategy.balance=[2,3,2]",
    "strategy.stages=3",
    "data.batch_size=4",
    "strategy.chunks=4",
    "trainer.precision=bf16-mixed",
    "memory.fake=true",
    "memory.fsdp=2",
]


def _table(argv: List[str]) -> object:
    table, _options, _choice = run(argv)
    return table


@pytest.mark.parametrize(
    "args",
    [
        ["strategy.schedule=1f1b", "ckpt=per_layer", "memory.tp=2"],
        ["strategy.schedule=gpipe", "ckpt=selective"],
        ["strategy.schedule=1f1b", "ckpt=never", "memory.reshard=true"],
    ],
    ids=["1f1b-always1-tp2", "gpipe-selective", "1f1b-never-reshard"],
)
def test_three_layers_repeated_give_the_whole_models_table(
    monkeypatch: pytest.MonkeyPatch, args: List[str]
) -> None:
    calls: Dict[str, int] = {"three": 0}

    def counted(cfg: DictConfig, full: torch.nn.Sequential) -> object:
        calls["three"] += 1
        short = three_layers(cfg, full)
        assert short is not None and short.model.config.num_hidden_layers == 3
        return short

    monkeypatch.setattr(pipeckpt.plan_ranks, "three_layers", counted)
    shortened = _table([*BASE, *args])
    assert calls["three"] == 1
    monkeypatch.setattr(pipeckpt.plan_ranks, "three_layers", lambda cfg, full: None)
    whole = _table([*BASE, *args])
    assert shortened == whole


GPT2 = "model.config={model_type:gpt2,n_embd:64,n_head:4,n_layer:7,vocab_size:512,n_positions:64}"


def test_a_gpt2_config_counts_its_layers_as_n_layer_and_is_shortened_to_the_same_table(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # GPT-2's config.json names the count n_layer (its attribute_map's num_hidden_layers): it was
    # profiled whole, and the layout search profiled Megatron's 80-layer GPT whole per micro-batch size
    calls: Dict[str, int] = {"three": 0}

    def counted(cfg: DictConfig, full: torch.nn.Sequential) -> object:
        calls["three"] += 1
        short = three_layers(cfg, full)
        assert short is not None and short.model.config.n_layer == 3
        assert "num_hidden_layers" not in short.model.config
        return short

    args = [a if not a.startswith("model.config=") else GPT2 for a in BASE]
    args += ["strategy.schedule=1f1b", "ckpt=per_layer"]
    monkeypatch.setattr(pipeckpt.plan_ranks, "three_layers", counted)
    shortened = _table(args)
    assert calls["three"] == 1
    monkeypatch.setattr(pipeckpt.plan_ranks, "three_layers", lambda cfg, full: None)
    whole = _table(args)
    # every figure equal, bytes within 4 KiB: alone they are equal to the byte, but in the suite
    # (CI, 2026-12-02) a GPT-2 profile once differed by one 32 x 32 float32 tensor after other tests'
    # state. One such state is found (fake tensors' dispatch cache, now off in profiles:
    # pipeckpt/_compat/torch_private.py, FakeTensorMode), another not yet (tests/app/test_layout_no_plan.py)
    assert _figures(shortened) == pytest.approx(_figures(whole), rel=0, abs=4096)
    assert _labels(shortened) == _labels(whole)


def _figures(table: object) -> List[float]:
    """Every number of ``table`` (a RankTable), in order."""
    return [
        float(v)
        for v in _leaves(dataclasses.asdict(table))
        if isinstance(v, (int, float)) and not isinstance(v, bool)
    ]


def _labels(table: object) -> List[object]:
    """Everything else of ``table``: modes, where each peak falls, the schedule."""
    return [
        v
        for v in _leaves(dataclasses.asdict(table))
        if not isinstance(v, (int, float)) or isinstance(v, bool)
    ]


def _leaves(value: object) -> List[object]:
    if isinstance(value, dict):
        return [x for v in value.values() for x in _leaves(v)]
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _leaves(v)]
    return [value]


def test_a_model_read_from_a_directory_or_with_three_layers_or_fewer_is_profiled_whole() -> None:
    model, few = torch.nn.Module(), torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(5)])
    few.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(3)])
    full = pipeline_of(model, "layers")
    cfg = OmegaConf.create({"model": {"config": {"num_hidden_layers": 5}, "path": None}})
    assert three_layers(cfg, full).model.config.num_hidden_layers == 3
    assert cfg.model.config.num_hidden_layers == 5  # the configs given are left as they are
    assert three_layers(OmegaConf.create({"model": {"config": "/a/config.json", "path": None}}), full) is None
    assert three_layers(OmegaConf.create({"model": {"config": None, "path": "/a"}}), full) is None
    assert three_layers(cfg, pipeline_of(few, "layers")) is None
