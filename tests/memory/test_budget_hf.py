"""A budget is a promise: ``checkpoint="auto"`` on a Hugging Face GPT-2 whose activations dominate
(SGD, no optimizer state), given per-block ``torch.utils.checkpoint``'s measured peak as its budget,
trains a whole step at or under it, 2 and 4 stages on the one CPU. Measured: every storage alive
during the second step (parameters, gradients, activations; ``harness.live_bytes``), as
``benchmarks/bench_hf_auto.py`` counts. Before the memory model counted what a ``pipeline_of`` model
holds beyond its layers' own (issue 36 item 5), the 2-stage pick measured 2.9% over its budget here.
And the terms that closed the gap, each checked on its own."""

import functools
from typing import Any, Dict, List, Optional

import lightning as L
import pytest
import torch
import transformers
from harness.live_bytes import LiveBytes
from support.trainers import quiet_trainer
from torch import Tensor, nn

import pipeckpt
from pipeckpt.checkpointing.modes import parse_mode
from pipeckpt.memory.profile import profile
from pipeckpt.memory.rooted import RootInput, root_microbatch
from pipeckpt.memory.stage_model import _StageModel

pytestmark = pytest.mark.usefixtures("one_thread")

LAYERS, WIDTH, HEADS, SEQ, BATCH, VOCAB = 4, 256, 4, 128, 4, 1024


def _gpt2(layers: int = LAYERS) -> transformers.GPT2LMHeadModel:
    config = transformers.GPT2Config(
        n_layer=layers, n_embd=WIDTH, n_head=HEADS, n_positions=SEQ, vocab_size=VOCAB, use_cache=False,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


class GPT2(L.LightningModule):
    def __init__(self, *, per_block: bool) -> None:
        super().__init__()
        self.model = _gpt2()
        if per_block:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def configure_pipeline(self) -> nn.Module:
        return pipeckpt.pipeline_of(self.model, "transformer.h")

    def training_step(self, batch: Dict[str, Tensor], batch_idx: int) -> Tensor:
        loss: Tensor = self.model(**batch).loss
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-4)


class SecondStepPeak(L.Callback):
    """The peak bytes alive during the second step (the first made the gradients)."""

    def __init__(self) -> None:
        self.peak = 0
        self._live: Optional[LiveBytes] = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # type: ignore[no-untyped-def]
        if batch_idx == 1:
            self._live = LiveBytes()
            self._live.count_step_state(pl_module, trainer.optimizers, batch)
            self._live.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
        if self._live is not None:
            self._live.__exit__(None, None, None)
            self.peak, self._live = self._live.peak, None


def _batches() -> List[Dict[str, Tensor]]:
    ids = torch.randint(0, VOCAB, (2, BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": x, "labels": x} for x in ids]


def _fit(module: L.LightningModule, strategy: Any = None) -> int:
    probe = SecondStepPeak()
    trainer = quiet_trainer(strategy, max_steps=2, callbacks=[probe])
    trainer.fit(module, torch.utils.data.DataLoader(_batches(), batch_size=None))
    return probe.peak


@functools.cache
def _per_block_peak() -> int:
    return _fit(GPT2(per_block=True))


@pytest.mark.parametrize("stages", [2, 4])
def test_auto_under_per_blocks_measured_peak_trains_at_or_under_it(stages: int) -> None:
    budget = _per_block_peak()
    strategy = pipeckpt.PipelineStrategy(stages=stages, chunks=2, checkpoint="auto", memory_budget=budget)
    measured = _fit(GPT2(per_block=False), strategy)
    plan = strategy.auto_plan
    assert plan.choice.process_peak is not None and plan.choice.process_peak <= budget
    assert measured <= budget, (plan.describe(), measured, budget, measured / budget)


def _profile(chunks: int) -> Any:
    model = _gpt2(layers=2)
    ids = _batches()[0]["input_ids"]
    call = RootInput((), {"input_ids": ids, "labels": ids})
    return profile(pipeckpt.pipeline_of(model, "transformer.h"), root_microbatch(call, chunks), rounds=1)


def test_a_layers_first_backward_keeps_the_weight_gradients_it_makes() -> None:
    fitted = _profile(chunks=2)
    block = fitted.layers[0]
    assert block.first_backward_peak is not None and block.backward_held_peak is not None
    # GPT-2's MLP runs backward from its output projection (WIDTH x 4 WIDTH floats): that gradient is
    # still held, fresh, while the GELU's backward allocates, where a later micro-batch has added it
    # into .grad and freed it.
    projection = WIDTH * 4 * WIDTH * 4
    assert block.first_backward_peak >= block.backward_held_peak + projection


def test_the_code_after_the_layers_saves_the_last_layers_output() -> None:
    fitted = _profile(chunks=2)
    assert fitted.outside is not None
    # GPT-2's final layer norm saves its input: one micro-batch's hidden state.
    assert fitted.outside.input_saved == BATCH // 2 * SEQ * WIDTH * 4


def test_a_pipeline_of_stage_recomputes_layer_by_layer_whatever_the_mode() -> None:
    fitted = _profile(chunks=2)
    stage = _StageModel(fitted, 0, 2, first=True, last=False, local=True)
    # Each layer call is its own checkpoint (stages/stage.py call_layer): every layer's input is kept,
    # the first one too (the embeddings' output, made per micro-batch by the model's own code).
    hidden = BATCH // 2 * SEQ * WIDTH * 4
    for name in ("always", "always:2", "always:1"):
        mode = parse_mode(name)
        assert stage.segments(mode, True) == [(0, 1), (1, 2)]
        assert stage.kept(mode, True) == 2 * hidden
