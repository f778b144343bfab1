"""Sharded data parallelism inside every stage (``data_parallel='fsdp'``) under the distributed engine.

One launch of 4 real processes (2 pipeline ranks x 2 replicas sharding each stage with FSDP2, gloo
on CPU, tests/engines/distributed/distributed_fsdp_worker.py) trains Hugging Face Llama and GPT-2
(tied input embedding and LM head) and the toy Sequential under gpipe, 1f1b, interleaved_1f1b and
zbv, with never, always and selective checkpointing, the gradients reduced once a step, and every
micro-batch (``reduce_every_microbatch``). Replica r reads rows 4r..4r+3 of every batch
of 8; each run's weights after its AdamW steps are compared with the module trained in this process
on the whole batches: within 1e-5 relative. Under bf16-mixed the weights stay fp32 and within
bf16's error of the fp32 reference. A toy run under checkpoint='auto' has a budget that only one rank's
sharded count fits. The first toy run is also the first leg of a resume chain through
other layouts (:data:`CHAIN`) that ends within 1e-6 of the uninterrupted run, and its last
distributed checkpoint converts to one file that loads strict=True into the unpipelined module.
"""

import functools
from pathlib import Path
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Tuple

import pytest
import support.ranks as ranks
import torch
from distributed_fsdp_worker import build, loader
from lightning.pytorch.callbacks import ModelCheckpoint
from support.toy import max_relative_difference
from test_distributed_pytree import _state
from torch import Tensor

from pipeckpt import PipeckptConfigError, PipelineStrategy, convert
from pipeckpt.engines.distributed.engine import DistributedEngine
from pipeckpt.settings import PipeSettings
from pipeckpt.state import sharded

HERE = Path(__file__).resolve().parent
WORKER = HERE / "distributed_fsdp_worker.py"
WORLD, DP = 4, 2
START_S = 600  # nine trainings of 4 processes on a loaded 2-core machine
EPOCH = 2  # steps of the toy data (two batches): a resume restarts an epoch's batches
CLIP = 0.05  # by norm: every shard counted once over the replicas and the pipeline
FSDP = dict(dp=DP, data_parallel="fsdp", chunks=2)
FOUR = dict(balance=[1, 1, 1, 1], virtual_stages=2)
EVERY = dict(reduce_every_microbatch=True)


class Leg(NamedTuple):
    """One layout of the resume chain: ``world`` processes (1: the local engine, in the test
    process) train the toy for one epoch from the previous leg's checkpoint."""

    name: str
    world: int
    strategy: Dict[str, Any]


# The resume chain: each leg is a new Trainer and module that resumes the previous leg's checkpoint
# (weights, AdamW's state, the loop's progress) and trains one more epoch; the last one ends within
# 1e-6 of the uninterrupted run. Consecutive distributed legs of one world share a launch (the
# first is :func:`four_processes`'s), so a layout is one entry, and an entry of another world
# costs a launch. Sharded state goes to whole tensors (pp4), back into shards on another cut
# (the place of a pp2 x tp2 x fsdp2 leg), to DDP replicas and to the local engine.
CHAIN = [
    Leg("toy_gpipe_selective", WORLD, dict(FSDP, balance=[3, 3], schedule="gpipe", checkpoint="selective")),
    Leg("chain_pp4", WORLD, dict(chunks=4, balance=[2, 1, 1, 2], schedule="1f1b", checkpoint="always")),
    Leg("chain_pp2_fsdp2", WORLD, dict(FSDP, balance=[4, 2], schedule="1f1b")),
    Leg("chain_pp2_ddp2", WORLD, dict(dp=DP, chunks=2, balance=[3, 3], schedule="gpipe")),
    Leg("chain_local_1_stage", 1, dict(stages=1, chunks=2)),
]
# checkpoint='auto' under a budget that one rank's sharded stage fits and a whole (DDP) one does not
# (tests/engines/distributed/test_distributed_auto.py checks that it lies between the two counts).
AUTO = (
    "toy_auto_sharded_budget",
    "toy",
    EPOCH,
    dict(FSDP, balance=[3, 3], schedule="gpipe", checkpoint="auto", memory_budget=12984),
    CLIP,
)
RUNS = [  # name, model, steps, strategy, clip
    (CHAIN[0].name, "toy", EPOCH, CHAIN[0].strategy, CLIP),
    ("llama_1f1b_always", "llama", 3, dict(FSDP, balance=[2, 2], schedule="1f1b", checkpoint="always"), None),
    (
        "llama_interleaved_never",
        "llama",
        3,
        dict(FSDP, **FOUR, schedule="interleaved_1f1b", checkpoint="never"),
        None,
    ),
    ("llama_zbv_never", "llama", 3, dict(FSDP, **FOUR, schedule="zbv_zero_bubble", checkpoint="never"), None),
    # One micro-batch a step: the engine lets FSDP2 reduce in the backward (wiring.LiveStage).
    ("llama_gpipe_one_microbatch", "llama", 3, dict(FSDP, chunks=1, balance=[2, 2], schedule="gpipe"), None),
    # reduce_every_microbatch: FSDP2 reduces in every micro-batch's backward (wiring.LiveStage).
    ("llama_1f1b_reduce_every", "llama", 3, dict(FSDP, balance=[2, 2], schedule="1f1b", **EVERY), None),
    (
        "llama_interleaved_reduce_every",
        "llama",
        3,
        dict(FSDP, **FOUR, schedule="interleaved_1f1b", checkpoint="always", **EVERY),
        None,
    ),
    (
        "gpt2_gpipe_selective",
        "gpt2",
        3,
        dict(FSDP, balance=[2, 2], schedule="gpipe", checkpoint="selective"),
        None,
    ),
    AUTO,
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


def test_reducing_every_micro_batch_without_sharding_is_refused():
    with pytest.raises(
        PipeckptConfigError, match=r"(?s)reduce_every_microbatch=True with data_parallel='ddp'.*HINT"
    ):
        _checked(reduce_every_microbatch=True)


def test_reducing_every_micro_batch_under_a_split_backward_is_refused_naming_the_schedule():
    with pytest.raises(
        PipeckptConfigError, match=r"(?s)reduce_every_microbatch=True with schedule='zbv_zero_bubble'.*HINT"
    ):
        _checked(
            reduce_every_microbatch=True, data_parallel="fsdp", schedule="zbv_zero_bubble", virtual_stages=2
        )


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


def _launches(legs: List[Leg]) -> List[List[Leg]]:
    """``legs`` as they run: consecutive distributed legs of one world share a launch (each starts
    a new Trainer and module; only the checkpoint carries the run), a local leg runs alone."""
    out: List[List[Leg]] = []
    for leg in legs:
        if out and leg.world > 1 and out[-1][-1].world == leg.world:
            out[-1].append(leg)
        else:
            out.append([leg])
    return out


def _steps(leg: Leg) -> int:
    return EPOCH * (CHAIN.index(leg) + 1)


def _written(leg: Leg, out: Path) -> Path:
    """The checkpoint ``leg`` writes into ``out`` at its epoch's last step (Lightning's
    ModelCheckpoint: resumed, the next leg starts the next epoch exactly)."""
    return out / leg.name / f"epoch={CHAIN.index(leg)}-step={_steps(leg)}.ckpt"


def _leg_spec(leg: Leg, resume: Optional[Path]) -> Dict[str, Any]:
    """The worker's run of ``leg``: one epoch more than the leg before it, from ``resume``."""
    run = _spec(leg.name, "toy", _steps(leg), leg.strategy, CLIP)
    return dict(run, checkpoint_every=EPOCH, resume=resume and str(resume))


@pytest.fixture(scope="module")
def four_processes(tmp_path_factory) -> Iterator[Path]:
    out = tmp_path_factory.mktemp("fsdp")
    first = _launches(CHAIN)[0]  # the chain's first leg is also a run of RUNS
    runs = [_leg_spec(leg, before and _written(before, out)) for before, leg in zip([None, *first], first)]
    runs += [_spec(*run) for run in RUNS if run[0] != CHAIN[0].name]
    runs.append(dict(_spec(*BF16, None), precision="bf16-mixed"))
    yield ranks.launch(WORKER, WORLD, runs, out, within_s=START_S)


def _local_leg(leg: Leg, resume: Path, out: Path) -> None:
    """``leg`` under the local engine in this process, from ``resume``."""
    module, data = build("toy")
    every = ModelCheckpoint(dirpath=out / leg.name, every_n_train_steps=EPOCH, save_top_k=-1)
    strategy = PipelineStrategy(**leg.strategy)
    options = dict(
        max_steps=_steps(leg), gradient_clip_val=CLIP, callbacks=[every], enable_checkpointing=True
    )
    torch.manual_seed(123)
    ranks.quiet_trainer(strategy, 1, **options).fit(module, loader(data), ckpt_path=resume)


@pytest.fixture(scope="module")
def chain(four_processes, tmp_path_factory) -> Dict[str, Path]:
    """The chain's legs after :func:`four_processes`'s launch: every leg's checkpoint by name."""
    launches = _launches(CHAIN)
    written = {leg.name: _written(leg, four_processes) for leg in launches[0]}
    for launch in launches[1:]:
        out = tmp_path_factory.mktemp(launch[0].name)
        resume = written[CHAIN[CHAIN.index(launch[0]) - 1].name]
        if launch[0].world == 1:
            _local_leg(launch[0], resume, out)
        else:
            runs = [
                _leg_spec(leg, _written(b, out) if b else resume) for b, leg in zip([None, *launch], launch)
            ]
            ranks.launch(WORKER, launch[0].world, runs, out, within_s=START_S)
        written.update({leg.name: _written(leg, out) for leg in launch})
    return written


def _checkpoint(path: Path) -> Dict[str, Any]:
    """A sharded checkpoint or a single file, read whole and weights-only."""
    return (
        sharded.load(path, weights_only=True)
        if sharded.is_sharded(path)
        else torch.load(path, weights_only=True)
    )


@functools.cache
def _trained(model: str, steps: int, clip: Optional[float]) -> Tuple[Dict[str, Tensor], Dict[str, Any]]:
    """``model`` trained in this process on the replicas' rows joined (the whole batches): its
    weights and its optimizer's state."""
    module, data = build(model)
    torch.manual_seed(123)
    trainer = ranks.quiet_trainer("auto", 1, max_steps=steps, gradient_clip_val=clip)
    trainer.fit(module, loader(data))
    return {k: v.detach().clone() for k, v in module.state_dict().items()}, trainer.optimizers[0].state_dict()


def _reference(model: str, steps: int, clip: Optional[float]) -> Dict[str, Tensor]:
    return _trained(model, steps, clip)[0]


@pytest.mark.slow
@pytest.mark.parametrize("run", RUNS, ids=[r[0] for r in RUNS])
def test_sharded_replicas_train_like_one_process_on_the_joined_batch(four_processes, run):
    name, model, steps, _, clip = run
    got = _state(four_processes / f"{name}.ckpt")["state_dict"]
    expected = _reference(model, steps, clip)
    assert sorted(got) == sorted(expected)  # the model's own keys, each once
    assert max_relative_difference(got, expected) < 1e-5


@pytest.mark.slow
def test_a_sharded_checkpoint_of_tied_weights_loads_strictly_into_the_unpipelined_module(four_processes):
    state = _state(four_processes / "gpt2_gpipe_selective.ckpt")["state_dict"]
    plain = build("gpt2")[0]
    plain.load_state_dict(state, strict=True)
    assert plain.model.lm_head.weight is plain.model.transformer.wte.weight  # the tie survives


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


@pytest.mark.slow
def test_a_run_resumed_through_every_layout_ends_like_the_uninterrupted_run(chain):
    steps = _steps(CHAIN[-1])
    got = _checkpoint(chain[CHAIN[-1].name])["state_dict"]
    assert max_relative_difference(got, _reference("toy", steps, CLIP)) < 1e-6
    assert max_relative_difference(got, _reference("toy", steps - EPOCH, CLIP)) > 1e-3  # the last leg trained


@pytest.mark.slow
def test_every_leg_of_the_chain_resumes_the_loops_where_the_leg_before_stopped(chain):
    progress = [(c["epoch"], c["global_step"]) for c in map(_checkpoint, chain.values())]
    assert progress == [(number, EPOCH * (number + 1)) for number in range(len(CHAIN))]


@pytest.mark.slow
def test_the_chains_last_distributed_checkpoint_converts_to_one_file_that_loads_strictly(chain, tmp_path):
    last = [leg for leg in CHAIN if leg.world > 1][-1]
    steps = _steps(last)
    convert.main([str(chain[last.name]), str(tmp_path / "plain.ckpt")])
    plain = torch.load(tmp_path / "plain.ckpt", weights_only=True)
    module = build("toy")[0]
    module.load_state_dict(plain["state_dict"], strict=True)
    optimizer = module.configure_optimizers()
    optimizer.load_state_dict(plain["optimizer_states"][0])  # at the plain module's positions
    weights, state = _trained("toy", steps, CLIP)
    assert max_relative_difference(module.state_dict(), weights) < 1e-6
    moments = {f"{i}.{k}": v for i, s in optimizer.state_dict()["state"].items() for k, v in s.items()}
    expected = {f"{i}.{k}": v for i, s in state["state"].items() for k, v in s.items()}
    assert max_relative_difference(moments, expected) < 1e-6  # AdamW's step and moments
