"""The memory model of a ``pipeline_of`` model against measurement: HF GPT-2 (head tied to the
embedding) and Llama (untied), with a vocabulary large enough that the head's logits and weight
gradients dominate. Measured: every storage one training step creates, as a Trainer runs it (the
previous step's gradients live until backward, AdamW's state and step), counted like MemTracker
(benchmarks/harness/stage_memory.py), parameters and state added. Predicted: from one profiled
micro-batch (memory/outside.py charges the code outside the layers per micro-batch). Tolerance: 3%."""

from typing import Dict, List

import pytest
import torch
import transformers
from harness.stage_memory import StageTracker
from torch import Tensor, nn

from pipeckpt import pipeline_of
from pipeckpt.engines.local.module import ModuleRunner
from pipeckpt.memory.auto import process_peak
from pipeckpt.memory.profile import profile
from pipeckpt.memory.rooted import RootInput, root_microbatch
from pipeckpt.stages.partition import plan

pytestmark = pytest.mark.usefixtures("one_thread")

#: Head-dominated: logits are batch x 16 x 6400 floats and the head's weight 6400 x 96, as GPT-2
#: small's 512 tokens x 50257 and 50257 x 768 are in its benchmark (benchmarks/bench_hf_auto.py).
VOCAB, WIDTH, BATCH, LENGTH = 6400, 96, 4, 16
CPU = torch.device("cpu")


def _gpt2() -> nn.Module:
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=LENGTH, n_embd=WIDTH, n_layer=4, n_head=2, use_cache=False,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def _llama() -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=LENGTH, use_cache=False,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


MODELS = {"gpt2": (_gpt2, "transformer.h"), "llama": (_llama, "model.layers")}


def _model(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name][0]()


def _batch() -> Dict[str, Tensor]:
    ids = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


def _trainer_step(model: nn.Module, batch: Dict[str, Tensor], optimizer: torch.optim.Optimizer) -> None:
    """Lightning's order: training_step, zero_grad, backward, step."""
    loss = model(**batch).loss
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()


def _measured_step(model: nn.Module, runner: ModuleRunner, batch: Dict[str, Tensor]) -> int:
    """The peak bytes of a second training step (the first made AdamW's state and the gradients)."""
    optimizer = torch.optim.AdamW(model.parameters())
    try:
        _trainer_step(model, batch, optimizer)
        state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, Tensor)]
        tracker = StageTracker(1)  # one "stage": the whole process
        tracker.exclude([*model.parameters(), *model.buffers(), *state, *batch.values()])
        tracker.adopt([p.grad for p in model.parameters() if p.grad is not None])  # freed by zero_grad
        with tracker:
            _trainer_step(model, batch, optimizer)
    finally:
        runner.restore()
        model.zero_grad(set_to_none=True)
    held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *state])
    return tracker.total_peak + held


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_a_pipeline_of_models_training_step_peak_is_predicted_within_three_percent(name) -> None:
    model, batch = _model(name), _batch()
    spec = pipeline_of(model, MODELS[name][1])
    off: Dict[str, float] = {}
    for chunks in (1, 2):
        fitted = profile(spec, root_microbatch(RootInput((), batch), chunks), rounds=1)
        for modes in (["never", "never"], ["always", "always"], ["never", "always:1"]):
            stage_plan = plan(spec, devices=[CPU], balance=[2, 2], checkpoint=modes, chunks=chunks)
            measured = _measured_step(
                model, ModuleRunner(spec, stage_plan, chunks=chunks, pin_memory=False), batch
            )
            predicted = process_peak(fitted, stage_plan, chunks=chunks, optimizer="adamw", stale_grads=True)
            off[f"{chunks} chunks, {'/'.join(modes)}"] = predicted / measured
    assert all(0.97 <= r <= 1.03 for r in off.values()), off


def test_the_code_outside_the_layers_keeps_one_micro_batchs_logits_and_log_probabilities() -> None:
    model, batch = _model("gpt2"), _batch()
    fitted = profile(pipeline_of(model, "transformer.h"), root_microbatch(RootInput((), batch), 2), rounds=1)
    logits = BATCH // 2 * LENGTH * VOCAB * 4
    assert fitted.outside is not None
    assert fitted.outside.outputs == logits + 4  # the logits and the 0-dim loss
    # The log-probabilities cross-entropy saves, and the head's small saved tensors (layer norm).
    assert logits <= fitted.outside.held <= 1.05 * logits


def test_a_tied_head_adds_its_weight_gradient_to_the_embeddings_in_their_backward() -> None:
    tied: List[int] = []
    for name in ("gpt2", "llama"):
        model = _model(name)
        fitted = profile(pipeline_of(model, MODELS[name][1]), RootInput((), _batch()), rounds=1)
        assert fitted.outside is not None
        tied.append(fitted.outside.before_backward)
    embedding = VOCAB * WIDTH * 4
    # GPT-2: the embedding's gradient and its sum with the head's; Llama: its own gradient only.
    assert tied[0] == pytest.approx(2 * embedding, rel=0.01) and tied[1] == pytest.approx(embedding, rel=0.01)
