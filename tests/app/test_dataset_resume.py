"""data=dataset resumes a mid-epoch checkpoint at the next unseen batch (issue 46, item 4): the
training loader (pipeckpt/app/data/dataset/resumable.py) saves its position (the shuffle's seed, the
epoch, the batches drawn) in the checkpoint, the same on every data-parallel replica, and a resumed
run trains on exactly the batches an uninterrupted one trains on, to the same parameters, without
Lightning's "dataloader is not resumable" warning, under the local engine and under the distributed
one with 2 stages x 2 replicas, and when ``max_steps`` stops the first run between two checkpoints
(its last.ckpt written at the end of the final step, before Lightning counts the epoch complete).

What Lightning does to the loader (lightning/pytorch/trainer/connectors/data_connector.py): it
rebuilds a training loader (``_update_dataloader``: the loader's class re-instantiated around a
``DistributedSampler`` of its own, which keeps no state) only when the run is distributed and the
loader's sampler is not a ``DistributedSampler``. The local engine's run is not distributed, and the
sampler here is a ``DistributedSampler``, so under both engines Lightning leaves the loader as it is:
the loader a run trains from (``trainer.train_dataloader``) is still the ``ResumableLoader`` with its
``ResumableSampler`` over the strategy's data-parallel replicas, as the probes of the runs below
record on every rank."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import lightning as L
import pytest
import torch
from support import forkserver, ranks
from support.loader_probe import read_probes
from support.paths import launcher_free, worker_pythonpath
from test_train_e2e import FAST, ROOT
from torch.utils.data import DataLoader

from pipeckpt.app.data.dataset.resumable import ResumableLoader
from pipeckpt.app.tiny_pretrained import make_tiny_pretrained
from pipeckpt.state import sharded

NOT_RESUMABLE = "your dataloader is not resumable"  # Lightning's warning, on one line as it prints it

# -- the loader alone -------------------------------------------------------------------------------

ROWS = 50  # 16 batches of 3 on one replica, 8 on each of two
REPLICAS = [(1, 0), (2, 0), (2, 1)]
REPLICA_IDS = ["1-replica", "2-replicas-rank0", "2-replicas-rank1"]


def loader(replicas: int = 1, rank: int = 0, seed: int = 7) -> ResumableLoader:
    return ResumableLoader(torch.arange(ROWS), batch_size=3, num_replicas=replicas, rank=rank, seed=seed)


def whole_epoch(data: ResumableLoader, epoch: int) -> List[List[int]]:
    """The epoch's batches, as Lightning draws them: the sampler's epoch set, then one pass."""
    data.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
    return [batch.tolist() for batch in data]


def draw(data: ResumableLoader, epoch: int, count: int) -> Iterator[Any]:
    """The epoch's pass begun and ``count`` batches drawn; the pass, suspended there, is returned."""
    data.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
    batches = iter(data)
    for _ in range(count):
        next(batches)
    return batches


@pytest.mark.parametrize("replicas, rank", REPLICAS, ids=REPLICA_IDS)
@pytest.mark.parametrize("epoch", [0, 1])
@pytest.mark.parametrize("drawn", [1, 5])
def test_a_loaded_state_continues_with_the_next_unseen_batch(replicas, rank, epoch, drawn):
    uninterrupted = whole_epoch(loader(replicas, rank), epoch)
    first = loader(replicas, rank)
    _pass = draw(first, epoch, drawn)
    state = first.state_dict()
    assert state == {"seed": 7, "epoch": epoch, "batches": drawn}
    resumed = loader(replicas, rank)
    resumed.load_state_dict(state)
    assert whole_epoch(resumed, epoch) == uninterrupted[drawn:]


def test_the_states_seed_orders_the_resumed_pass_whatever_seed_the_loader_was_made_with():
    first = loader(seed=7)
    _pass = draw(first, 0, 2)
    resumed = loader(seed=8)
    resumed.load_state_dict(first.state_dict())
    assert whole_epoch(resumed, 0) == whole_epoch(loader(seed=7), 0)[2:]
    assert whole_epoch(loader(seed=8), 0) != whole_epoch(loader(seed=7), 0)


@pytest.mark.parametrize("replicas, rank", REPLICAS, ids=REPLICA_IDS)
def test_a_state_saved_at_the_end_of_an_epoch_resumes_the_next_epoch_from_its_first_batch(replicas, rank):
    first = loader(replicas, rank)
    epoch0 = whole_epoch(first, 0)
    state = first.state_dict()
    assert state == {"seed": 7, "epoch": 0, "batches": len(epoch0)}
    resumed = loader(replicas, rank)
    resumed.load_state_dict(state)
    epoch1 = whole_epoch(resumed, 1)  # Lightning starts the next epoch
    assert epoch1 == whole_epoch(loader(replicas, rank), 1)
    assert len(epoch1) == len(epoch0) and epoch1 != epoch0


def test_a_state_taken_once_the_next_epoch_is_set_has_drawn_none_of_it():
    """Lightning sets the next epoch on the sampler before that epoch's hooks run and before its
    first batch: a checkpoint written then must not skip that epoch's batches."""
    first = loader()
    whole_epoch(first, 0)
    first.sampler.set_epoch(1)  # type: ignore[attr-defined]
    state = first.state_dict()
    assert state == {"seed": 7, "epoch": 1, "batches": 0}
    resumed = loader()
    resumed.load_state_dict(state)
    assert whole_epoch(resumed, 1) == whole_epoch(loader(), 1)


def test_a_loaded_state_is_saved_unchanged_until_its_pass_draws_a_batch():
    """A resumed run checkpointed before its first batch (Lightning loads the state, then starts
    the pass) writes the position it was given, not the start of the epoch."""
    resumed = loader()
    resumed.load_state_dict({"seed": 7, "epoch": 0, "batches": 3})
    assert resumed.state_dict() == {"seed": 7, "epoch": 0, "batches": 3}
    batches = draw(resumed, 0, 0)  # the pass exists, nothing drawn
    assert resumed.state_dict() == {"seed": 7, "epoch": 0, "batches": 3}
    next(batches)
    assert resumed.state_dict() == {"seed": 7, "epoch": 0, "batches": 4}


@pytest.mark.parametrize("drawn", [0, 3, 8])  # 8: the whole epoch
def test_every_replica_saves_the_same_state_from_its_own_rows(drawn):
    replica0, replica1 = loader(2, 0), loader(2, 1)
    _passes = draw(replica0, 0, drawn), draw(replica1, 0, drawn)
    assert replica0.state_dict() == replica1.state_dict() == {"seed": 7, "epoch": 0, "batches": drawn}
    rows0 = {row for batch in whole_epoch(loader(2, 0), 0) for row in batch}
    rows1 = {row for batch in whole_epoch(loader(2, 1), 0) for row in batch}
    assert not rows0 & rows1


# -- under Lightning, in this process -----------------------------------------------------------


class _Linear(L.LightningModule):
    """A linear model of the rows' values, recording the rows of each batch it trains on."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.seen: List[List[int]] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.seen.append(batch.tolist())
        return self.layer(batch.float().unsqueeze(1)).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class _SaveAt(L.Callback):
    """Writes a checkpoint at the end of the batch that makes step ``step``, as a preemption does."""

    def __init__(self, step: int, path: Path) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


def _fit(quiet_trainer: Any, data: DataLoader, steps: int, **fit: Any) -> Tuple[L.Trainer, _Linear]:
    trainer, model = quiet_trainer(max_steps=steps, **fit.pop("trainer", {})), _Linear()
    trainer.fit(model, data, **fit)
    return trainer, model


@pytest.mark.parametrize("resumable", [True, False], ids=["ResumableLoader", "DataLoader-control"])
def test_lightning_resumes_a_mid_epoch_checkpoint_at_the_next_batch_without_its_warning(
    tmp_path, quiet_trainer, recwarn, resumable
):
    """The control: a plain shuffled DataLoader draws the warning (so its absence means something)."""

    def data() -> DataLoader:
        if resumable:
            return loader()
        return DataLoader(torch.arange(ROWS), batch_size=3, shuffle=True, drop_last=True)

    torch.manual_seed(0)
    _, uninterrupted = _fit(quiet_trainer, data(), 6)
    torch.manual_seed(0)
    _fit(quiet_trainer, data(), 6, trainer={"callbacks": [_SaveAt(3, tmp_path / "step3.ckpt")]})
    recwarn.clear()
    trainer, resumed = _fit(quiet_trainer, data(), 6, ckpt_path=str(tmp_path / "step3.ckpt"))
    warned = [str(w.message) for w in recwarn if NOT_RESUMABLE in str(w.message)]
    if resumable:
        assert isinstance(trainer.train_dataloader, ResumableLoader)
        assert resumed.seen == uninterrupted.seen[3:] and not warned
    else:
        assert len(warned) == 1


# -- train.py, in processes of its own ------------------------------------------------------------

STEPS, HALF = 6, 3  # an epoch is 71 batches of 4 on one replica, 35 on each of two
APP = [
    "model=hf",
    "data=dataset",
    "data.format=text",
    "model.seq_len=32",
    "data.batch_size=4",
    "strategy.chunks=2",
    "trainer.accelerator=cpu",
    f"trainer.val_check_interval={HALF}",  # the checkpoint mid-epoch: ModelCheckpoint after validation
    "trainer.limit_val_batches=1",
    "validate=false",
    "~callbacks.stage_report",
    "+callbacks.loader_probe._target_=support.loader_probe.LoaderProbe",
    "+callbacks.loader_probe.dirpath=${output_dir}/probe",
]
DISTRIBUTED = ["strategy.engine=distributed", "trainer.devices=4", "strategy.stages=2", "strategy.dp=2"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_pretrained(tmp_path_factory.mktemp("hf") / "tiny-llama", "llama")


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> Path:
    """300 distinct text rows: any batch out of place changes the parameters."""
    words = "the cat sat on a mat and the dog ran to it while birds sang".split()
    texts = [
        f"row {i}: " + " ".join(words[(i * 7 + k * k) % 15] for k in range(4 + i % 9)) for i in range(300)
    ]
    path = tmp_path_factory.mktemp("rows") / "rows.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def app_env(tmp_path: Path) -> Dict[str, str]:
    """The runs' environment: datasets' cache in the test's folder, nothing written to ~/.cache;
    warnings shown (the fork server takes PYTHONWARNINGS), the probe importable."""
    return {
        "HF_DATASETS_CACHE": str(tmp_path / "datasets-cache"),
        "PYTHONWARNINGS": "default",
        "PYTHONPATH": worker_pythonpath(),
    }


def run_app(out: Path, tmp_path: Path, *overrides: str, processes: int = 1) -> str:
    """train.py to its end, its run directory ``out``: one process, or ``processes`` ranks started as
    torchrun starts them (forked, each with its LOCAL_RANK); returns what they printed. No process
    outlives the call."""
    args = [*FAST, f"hydra.run.dir={out}", *APP, *overrides]
    if processes == 1:
        env = dict(launcher_free(os.environ), **app_env(tmp_path))
        done = forkserver.run([sys.executable, "train.py", *args], cwd=ROOT, env=env, timeout=300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return done.stdout + done.stderr
    env = dict(ranks.rank_env(processes), **app_env(tmp_path))
    logs = [out.parent / f"{out.name}-rank{r}.log" for r in range(processes)]
    started = [
        ranks.spawn(ROOT / "train.py", args, dict(env, LOCAL_RANK=str(r)), r, ROOT, logs[r])
        for r in range(processes)
    ]
    try:
        deadline = time.monotonic() + 300
        for proc in started:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pytest.fail("the ranks did not finish in 300 s:\n" + logs[0].read_text()[-4000:])
    finally:
        ranks.stop(started)
    output = "\n".join(log.read_text(errors="replace") for log in logs)
    assert [p.returncode for p in started] == [0] * processes, output[-6000:]
    return output


def parameters(out: Path) -> Dict[str, torch.Tensor]:
    path = out / "checkpoints" / "last.ckpt"
    checkpoint = sharded.load(path) if path.is_dir() else torch.load(path, map_location="cpu")
    return checkpoint["state_dict"]


def max_difference(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def common(tiny: Path, rows: Path) -> List[str]:
    return [f"model.path={tiny}", f"data.path={rows}"]


def interrupted_and_resumed(
    out: Path, tiny: Path, rows: Path, *overrides: str, stop_at: int = HALF, processes: int
) -> str:
    """A run stopped at ``stop_at`` (in ``out/half``) and one resumed from its last.ckpt to STEPS (in
    ``out/resumed``); returns what the resumed run printed."""
    args = [*common(tiny, rows), *overrides]
    run_app(out / "half", out, *args, f"trainer.max_steps={stop_at}", processes=processes)
    resume = f"ckpt_path={out / 'half' / 'checkpoints' / 'last.ckpt'}"
    return run_app(out / "resumed", out, *args, f"trainer.max_steps={STEPS}", resume, processes=processes)


def batches(out: Path, rank: int) -> Dict[int, str]:
    """The digest of the batch each step of ``out``'s run trained on, on ``rank``."""
    return {r["step"]: r["batch"] for r in read_probes(out / "probe", rank) if "step" in r}


def check_resumed(whole: Path, out: Path, output: str, replica_of: List[int], *, stop_at: int = HALF) -> None:
    """What every rank of the resumed run saw, against the uninterrupted run ``whole``, and the
    final parameters of both."""
    assert "Restored all states from the checkpoint" in output
    assert NOT_RESUMABLE not in output
    for rank, replica in enumerate(replica_of):
        start = read_probes(out / "resumed" / "probe", rank)[0]
        assert start == {
            "loader": "ResumableLoader",
            "sampler": "ResumableSampler",
            "num_replicas": max(replica_of) + 1,
            "rank": replica,
            "state": {"seed": 0, "epoch": 0, "batches": stop_at},
        }
        uninterrupted = batches(whole, rank)
        assert sorted(uninterrupted) == list(range(STEPS))
        assert batches(out / "resumed", rank) == {s: uninterrupted[s] for s in range(stop_at, STEPS)}
    final = parameters(whole)
    # The steps after the stop move the parameters by far more than the tolerance (3e-4 here).
    assert max_difference(final, parameters(out / "half")) > 1e-4
    assert max_difference(final, parameters(out / "resumed")) <= 1e-6


@pytest.fixture(scope="module")
def whole_local(tmp_path_factory, tiny, rows) -> Path:
    """The uninterrupted run of STEPS steps under the local engine."""
    out = tmp_path_factory.mktemp("local")
    run_app(out / "whole", out, *common(tiny, rows), "strategy.engine=local", f"trainer.max_steps={STEPS}")
    return out / "whole"


def test_the_local_engine_resumes_mid_epoch_with_the_next_unseen_batch(tmp_path, whole_local, tiny, rows):
    output = interrupted_and_resumed(tmp_path, tiny, rows, "strategy.engine=local", processes=1)
    check_resumed(whole_local, tmp_path, output, replica_of=[0])


def test_a_run_stopped_by_max_steps_between_checkpoints_resumes_mid_epoch(tmp_path, whole_local, tiny, rows):
    output = interrupted_and_resumed(tmp_path, tiny, rows, "strategy.engine=local", stop_at=4, processes=1)
    check_resumed(whole_local, tmp_path, output, replica_of=[0], stop_at=4)


@pytest.mark.slow
def test_the_distributed_engine_with_two_replicas_resumes_mid_epoch_with_the_next_unseen_batch(
    tmp_path, tiny, rows
):
    run_app(
        tmp_path / "whole",
        tmp_path,
        *common(tiny, rows),
        *DISTRIBUTED,
        f"trainer.max_steps={STEPS}",
        processes=4,
    )
    output = interrupted_and_resumed(tmp_path, tiny, rows, *DISTRIBUTED, processes=4)
    check_resumed(tmp_path / "whole", tmp_path, output, replica_of=[0, 0, 1, 1])
    # The two processes of one pipeline read the same batches; the two replicas, different ones.
    whole = [batches(tmp_path / "whole", rank) for rank in range(4)]
    assert whole[0] == whole[1] and whole[2] == whole[3]
    assert set(whole[0].values()).isdisjoint(whole[2].values())
