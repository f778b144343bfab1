"""Sharded data parallelism inside every stage (``data_parallel='fsdp'``) under the distributed engine.

One launch of 4 real processes (2 pipeline ranks x 2 replicas sharding each stage with FSDP2, gloo
on CPU, tests/engines/distributed/distributed_fsdp_worker.py) trains Hugging Face Llama and GPT-2
(tied input embedding and LM head) and the toy Sequential under gpipe, 1f1b, interleaved_1f1b and
zbv, with never, always and selective checkpointing. Replica r reads rows 4r..4r+3 of every batch
of 8; each run's weights after its AdamW steps are compared with the module trained in this process
on the whole batches: within 1e-5 relative. A run saved sharded resumes under DDP and under FSDP,
and every checkpoint loads strict=True into the unpipelined module; under bf16-mixed the weights
stay fp32 and within bf16's error of the fp32 reference.
"""

import functools
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import pytest
import support.ranks as ranks
import torch
from distributed_fsdp_worker import build, loader
from support.toy import max_relative_difference
from test_distributed_pytree import _state

from pipeckpt import PipeckptConfigError
from pipeckpt.engines.distributed.engine import DistributedEngine
from pipeckpt.settings import PipeSettings

HERE = Path(__file__).resolve().parent
WORKER = HERE / "distributed_fsdp_worker.py"
WORLD, DP = 4, 2
START_S = 600  # six trainings of 4 processes on a loaded 2-core machine
CLIP = 0.05  # by norm: every shard counted once over the replicas and the pipeline
FSDP = dict(dp=DP, data_parallel="fsdp", chunks=2)
FOUR = dict(balance=[1, 1, 1, 1], virtual_stages=2)
RUNS = [  # name, model, steps, strategy, clip
    (
        "toy_gpipe_selective",
        "toy",
        2,
        dict(FSDP, balance=[3, 3], schedule="gpipe", checkpoint="selective"),
        CLIP,
    ),
    ("llama_1f1b_always", "llama", 3, dict(FSDP, balance=[2, 2], schedule="1f1b", checkpoint="always"), None),
    (
        "llama_interleaved_never",
        "llama",
        3,
        dict(FSDP, **FOUR, schedule="interleaved_1f1b", checkpoint="never"),
        None,
    ),
    ("llama_zbv_never", "llama", 3, dict(FSDP, **FOUR, schedule="zbv_zero_bubble", checkpoint="never"), None),
    (
        "gpt2_gpipe_selective",
        "gpt2",
        3,
        dict(FSDP, balance=[2, 2], schedule="gpipe", checkpoint="selective"),
        None,
    ),
]
# The toy run's sharded checkpoint (2 steps), resumed for its third step under DDP and under FSDP
# (which loads the full tensors as this rank's shards, optimizer state included).
TOY = dict(dp=DP, chunks=2, balance=[3, 3], schedule="gpipe")
RESUMED = [
    ("toy_resumed_under_ddp", "toy", 3, TOY, CLIP),
    ("toy_resumed_under_fsdp", "toy", 3, dict(TOY, data_parallel="fsdp"), CLIP),
]

# bf16-mixed: FSDP computes in bf16 and keeps fp32 master weights, compared with the fp32 reference.
BF16 = (
    "llama_bf16_1f1b_always",
    "llama",
    3,
    dict(FSDP, balance=[2, 2], schedule="1f1b", checkpoint="always"),
)
BF16_TOLERANCE = 1e-2  # bf16 rounds to 8 bits of mantissa (eps 7.8e-3)

# -- without processes -------------------------------------------------------------------


def _checked(**settings: Any) -> None:
    DistributedEngine.check_settings(PipeSettings(engine="distributed", **settings))


def test_an_unknown_data_parallel_kind_is_refused_naming_the_kinds():
    with pytest.raises(PipeckptConfigError, match=r"(?s)data_parallel='zero3'.*\['ddp', 'fsdp'\].*HINT"):
        _checked(data_parallel="zero3")


def test_resharding_after_forward_without_sharding_is_refused():
    with pytest.raises(
        PipeckptConfigError, match=r"(?s)reshard_after_forward=True with data_parallel='ddp'.*HINT"
    ):
        _checked(reshard_after_forward=True)


def test_data_parallel_is_refused_by_the_local_engine():
    with pytest.raises(PipeckptConfigError, match=r"data_parallel"):
        from pipeckpt.engines.local.engine import LocalEngine

        LocalEngine.check_settings(PipeSettings(data_parallel="fsdp"))


def test_the_private_fsdp_lazy_init_that_makes_a_stage_its_layers_root_exists():
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    assert callable(FSDPState._lazy_init)  # pipeckpt._compat.make_fsdp_root calls it


# -- four real processes -----------------------------------------------------------------


def _spec(
    name: str, model: str, steps: int, strategy: Dict[str, Any], clip: Optional[float]
) -> Dict[str, Any]:
    return dict(name=name, model=model, steps=steps, strategy=strategy, gradient_clip_val=clip)


@pytest.fixture(scope="module")
def four_processes(tmp_path_factory) -> Iterator[Path]:
    runs: List[Dict[str, Any]] = [_spec(*run) for run in RUNS]
    runs += [dict(_spec(*run), resume=f"{RUNS[0][0]}.ckpt") for run in RESUMED]
    runs.append(dict(_spec(*BF16, None), precision="bf16-mixed"))
    yield ranks.launch(WORKER, WORLD, runs, tmp_path_factory.mktemp("fsdp"), within_s=START_S)


@functools.cache
def _reference(model: str, steps: int, clip: Optional[float]) -> Dict[str, torch.Tensor]:
    """``model`` trained in this process on the replicas' rows joined (the whole batches)."""
    module, data = build(model)
    torch.manual_seed(123)
    ranks.quiet_trainer("auto", 1, max_steps=steps, gradient_clip_val=clip).fit(module, loader(data))
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.mark.slow
@pytest.mark.parametrize("run", [*RUNS, *RESUMED], ids=[r[0] for r in [*RUNS, *RESUMED]])
def test_sharded_replicas_train_like_one_process_on_the_joined_batch(four_processes, run):
    name, model, steps, _, clip = run
    got = _state(four_processes / f"{name}.ckpt")["state_dict"]
    expected = _reference(model, steps, clip)
    assert sorted(got) == sorted(expected)  # the model's own keys, each once
    assert max_relative_difference(got, expected) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2_gpipe_selective", "toy_gpipe_selective"])
def test_a_sharded_checkpoint_loads_strictly_into_the_unpipelined_module(four_processes, name):
    state = _state(four_processes / f"{name}.ckpt")["state_dict"]
    plain = build(name.split("_")[0])[0]
    plain.load_state_dict(state, strict=True)
    if name.startswith("gpt2"):  # the tie survives: one parameter
        assert plain.model.lm_head.weight is plain.model.transformer.wte.weight


@pytest.mark.slow
def test_each_replica_holds_half_of_its_stages_sharded_parameters_and_optimizer_state(four_processes):
    held = [torch.load(four_processes / f"llama_1f1b_always.rank{r}.pt") for r in range(WORLD)]
    for first in range(WORLD // DP):  # ranks first and first + 2 hold the same stage
        a, b = held[first], held[first + WORLD // DP]
        sharded = [n for n, p in a["params"].items() if p["sharded"]]
        assert sharded, f"rank {first} holds no sharded parameter"
        for n in sharded:
            assert (
                a["params"][n]["numel"] + b["params"][n]["numel"] == _reference("llama", 3, None)[n].numel()
            )
        states = [s for s in a["state"] if s["sharded"]]
        assert len(states) == 2 * len(sharded)  # AdamW's two moments, sharded like their parameters


@pytest.mark.slow
def test_bf16_mixed_trains_within_bf16_error_keeping_fp32_weights(four_processes):
    name, model, steps, _ = BF16
    got = _state(four_processes / f"{name}.ckpt")["state_dict"]
    assert {v.dtype for v in got.values()} == {torch.float32}  # the sharded master weights
    assert max_relative_difference(got, _reference(model, steps, None)) < BF16_TOLERANCE
