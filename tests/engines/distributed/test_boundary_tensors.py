"""What crosses a process boundary, and batches that do not cut into ``chunks``.

Any tensor crosses: non-contiguous views, strided slices, channels_last, 0-dim, integer and bool
tensors and floating ones without a gradient, in one stage output; and Hugging Face T5, whose
blocks hand on their position bias as a non-contiguous view. A last batch of 5 samples with
chunks=4 under 1F1B on 2 ranks runs as 5 micro-batches of one; where no count of equal
micro-batches fits the schedule, the loader's last batch is refused at the first step, before
any training. Each run trains under engine="distributed" (2 processes, gloo) within 1e-5 of the
local engine."""

import warnings
from pathlib import Path
from typing import Any, Dict, Iterator

import pytest
import support.ranks as ranks
import torch
from boundary_tensors_worker import OddTensors, module_and_data, odd_data
from support.toy import max_relative_difference
from test_distributed_pytree import _state

from pipeckpt import PipeckptConfigError, PipeckptWarning, PipelineStrategy
from pipeckpt.engines.distributed.boundaries import sendable
from pipeckpt.engines.distributed.microbatch_counts import last_batch_size
from pipeckpt.engines.distributed.step import PipelinedStep

HERE = Path(__file__).resolve().parent
WORKER = HERE / "boundary_tensors_worker.py"
STEPS = 2
ONE_F_ONE_B = dict(balance=[1, 1], chunks=4, schedule="1f1b", checkpoint="always")
RUNS = [
    dict(name="odd", model="odd", strategy=ONE_F_ONE_B),
    dict(name="short", model="odd", samples=13, strategy=ONE_F_ONE_B),  # its second batch: 5 samples
    dict(name="t5", model="t5", strategy=dict(ONE_F_ONE_B, balance=[2, 2], chunks=2, checkpoint="never")),
]


def test_every_tensor_of_a_stage_output_goes_contiguous_and_keeps_its_graph():
    layer = OddTensors().layers[0]
    out = layer(torch.randn(4, 4))
    flat = sendable(tuple(out.values()))
    assert all(t.is_contiguous() for t in flat)
    for sent, made in zip(flat, out.values()):
        assert torch.equal(sent, made) and sent.dtype == made.dtype
        assert sent.requires_grad == made.requires_grad
    assert sendable(out["scalar"]) is out["scalar"]  # contiguous already: the very tensor
    flat[0].sum().backward()  # the copy's gradient reaches the layer
    assert layer.lin.weight.grad is not None


def _step(quiet_trainer: Any, schedule: str, **options: Any) -> PipelinedStep:
    strategy = PipelineStrategy(engine="distributed", chunks=4, schedule=schedule, **options)
    engine = quiet_trainer(strategy, devices=2).strategy.engine
    return PipelinedStep(None, None, [], engine.processes, chunks=4, device=torch.device("cpu"))


SCHEDULES = [
    ("GPipe", 1),
    ("1F1B", 1),
    ("Interleaved1F1B", 2),
    ("LoopedBFS", 2),
    ("InterleavedZeroBubble", 2),
]
SCHEDULES += [("ZBVZeroBubble", 2), ("DualPipeV", 2)]


def test_a_short_batch_no_count_up_to_chunks_fits_runs_as_more_smaller_microbatches(quiet_trainer):
    step = _step(quiet_trainer, "1f1b")
    with pytest.warns(match=r"batch of 5 samples.*runs as 5 micro-batches"):
        assert step.counts.of(5, train=True) == 5
    with pytest.raises(PipeckptConfigError, match=r"batch of 1 samples.*HINT: .*drop_last"):
        step.counts.of(1, train=True)  # one sample cannot fill two stages


@pytest.mark.parametrize("schedule, virtual", SCHEDULES)
def test_a_batch_of_5_with_chunks_4_runs_under_every_schedule(quiet_trainer, schedule, virtual):
    step = _step(quiet_trainer, schedule, virtual_stages=virtual, checkpoint="never")
    with pytest.warns(match=r"batch of 5 samples"):
        assert 5 % step.counts.of(5, train=True) == 0


def test_the_last_batch_is_sized_ahead_from_the_loader():
    assert last_batch_size(odd_data(13)) == 5
    assert last_batch_size(odd_data(16)) is None  # none smaller
    loader = odd_data(13)
    dropped = torch.utils.data.DataLoader(loader.dataset, batch_size=8, drop_last=True)
    assert last_batch_size(dropped) is None and last_batch_size([1, 2]) is None


def _local(spec: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    module, loader = module_and_data(spec["model"], spec.get("samples", 16))
    settings = {k: v for k, v in spec["strategy"].items() if k != "schedule"}
    strategy = PipelineStrategy(stages=len(settings["balance"]), **settings)
    torch.manual_seed(123)
    with warnings.catch_warnings():  # the short batch's fewer micro-batches, told
        warnings.simplefilter("ignore", PipeckptWarning)
        ranks.quiet_trainer(strategy, 1, max_steps=STEPS).fit(module, loader)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory: Any) -> Iterator[Path]:
    runs = [dict(r, steps=STEPS) for r in RUNS]
    yield ranks.launch(WORKER, 2, runs, tmp_path_factory.mktemp("boundary"), within_s=240)


@pytest.mark.slow
@pytest.mark.parametrize("spec", RUNS, ids=[r["name"] for r in RUNS])
def test_trains_across_two_processes_like_the_local_engine(two_processes, spec):
    pytest.importorskip("transformers")
    got = _state(two_processes / f"{spec['name']}.ckpt")["state_dict"]
    assert max_relative_difference(got, _local(spec)) < 1e-5
