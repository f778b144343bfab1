"""The step-peak counter of ``bench_hf_auto.py`` (``harness.live_bytes``): it counts what torch's
MemTracker counts on a plain step, and it shows a selective stage's true peak, which MemTracker's own
hooks raise (they keep the inputs of selectively recomputed layers alive)."""

from typing import Dict, List, Optional

import lightning as L
import pytest
import torch
import transformers
from harness.live_bytes import LiveBytes
from support.trainers import quiet_trainer
from torch import Tensor, nn

import pipeckpt
from pipeckpt._compat import MemTracker

SEQ, BATCH = 8, 2


class WideGPT2(L.LightningModule):
    """A GPT-2 whose step peaks at AdamW's update (wide layers, a short sequence), as GPT-2 small's
    does at the benchmark's shape."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        config = transformers.GPT2Config(
            vocab_size=64, n_positions=SEQ, n_embd=256, n_layer=2, n_head=4, use_cache=False,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        self.model = transformers.GPT2LMHeadModel(config)

    def configure_pipeline(self) -> nn.Module:
        return pipeckpt.pipeline_of(self.model, "transformer.h")

    def training_step(self, batch: Dict[str, Tensor], batch_idx: int) -> Tensor:
        loss: Tensor = self.model(**batch).loss
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class SecondStepPeak(L.Callback):
    """The peak of the second step (the first makes AdamW's state), by LiveBytes or MemTracker."""

    def __init__(self, counter: str) -> None:
        self.counter = counter
        self.peak = 0
        self.peak_op = ""
        self._live: Optional[LiveBytes] = None
        self._tracker: Optional[MemTracker] = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # type: ignore[no-untyped-def]
        if batch_idx != 1:
            return
        if self.counter == "live":
            self._live = LiveBytes()
            self._live.count_step_state(pl_module, trainer.optimizers, batch)
            self._live.__enter__()
        else:
            self._tracker = MemTracker()
            self._tracker.track_external(pl_module, *trainer.optimizers)
            self._tracker.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
        if self._live is not None:
            self._live.__exit__(None, None, None)
            self.peak, self.peak_op, self._live = self._live.peak, self._live.peak_op, None
        if self._tracker is not None:
            self._tracker.__exit__(None, None, None)
            snapshot = self._tracker.get_tracker_snapshot("peak")
            self.peak, self._tracker = sum(d["Total"] for d in snapshot.values()), None


def batches() -> List[Dict[str, Tensor]]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (2, BATCH, SEQ), generator=g)
    return [{"input_ids": x, "labels": x} for x in ids]


def second_step_peak(modes: Optional[List[str]], counter: str) -> SecondStepPeak:
    probe = SecondStepPeak(counter)
    pipe = None if modes is None else pipeckpt.PipelineStrategy(stages=2, chunks=1, checkpoint=modes)
    trainer = quiet_trainer(pipe, max_steps=2, callbacks=[probe])
    trainer.fit(WideGPT2(), torch.utils.data.DataLoader(batches(), batch_size=None))
    return probe


def test_live_bytes_counts_a_plain_step_as_memtracker_does() -> None:
    assert second_step_peak(None, "live").peak == second_step_peak(None, "memtracker").peak > 0


@pytest.mark.parametrize("modes", [["never", "selective"], ["selective", "selective"]])
def test_a_selective_stage_adds_nothing_to_a_step_that_peaks_at_the_update(modes: List[str]) -> None:
    never = second_step_peak(["never", "never"], "live")
    selective = second_step_peak(modes, "live")
    assert never.peak_op == selective.peak_op == "aten.div.Tensor"  # AdamW's update: exp_avg_sq.sqrt() / ...
    assert selective.peak == never.peak


def test_a_tensor_on_the_meta_device_is_not_counted() -> None:
    # The distributed engine leaves another rank's stages on the meta device: their parameters
    # report their bytes but hold none (a pp4 rank of the layout benchmark's Llama: 20-25 MiB).
    live, kept = LiveBytes(), torch.empty(256)
    live.count([torch.empty(1024, device="meta"), kept])
    with live:
        made = torch.empty(1024, device="meta") * 2
    assert made.is_meta
    assert live.peak == live.live == 256 * 4


def test_a_storage_resized_in_place_is_counted_at_its_new_size() -> None:
    # FSDP2 frees a unit's gathered parameters by resizing their storage to 0 and gathers them again
    # into the same storage: counted at its first size, a resharded unit would be held all step.
    live = LiveBytes()
    with live:
        gathered = torch.ones(1024)  # 4 KiB, counted as the op returns it
        gathered.untyped_storage().resize_(0)
        assert live.live == 0
        gathered.untyped_storage().resize_(2048 * 4)
        assert live.live == 2048 * 4
    assert live.peak == 2048 * 4 and live.peak_op == "UntypedStorage.resize_"


def test_resize_is_wrapped_only_while_counting() -> None:
    original = torch.UntypedStorage.resize_
    with LiveBytes():
        assert torch.UntypedStorage.resize_ is not original
    assert torch.UntypedStorage.resize_ is original
