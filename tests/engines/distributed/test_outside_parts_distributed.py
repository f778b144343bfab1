"""The parts of a ``pipeline_of`` model outside its layers are held by the stages that read them
(docs/DISTRIBUTED.md, "Parts outside the layers"), and training still equals one process. Real
processes (gloo on CPU, outside_parts_worker.py beside this file): HF Llama with vocabulary 32000,
hidden 128 and 4 layers (its embedding and head 94% of its parameters) as pp2, pp4, pp2 x fsdp2
(the embedding and head sharded over the replicas too) and pp2 x tp2 (the model's own plan: the
layers' projections, and the embedding and head split over the vocabulary);
Gemma3 (head tied to a scaled embedding), BART (one embedding under four names; encoder and decoder
layers) and Qwen3-MoE as pp2. Each trains 3 steps by SGD on the same batches on every rank (the
replicas too) and is compared with the unpipelined model trained in this process: every tensor a
rank holds within 1e-5 of it, relative to the model's largest weight (per tensor would be noise: the
attention key biases, which softmax ignores, train on rounding error alone), each tensor held by
exactly the ranks whose stages read it."""

import functools
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import pytest
import support.ranks as ranks
import torch
from support.seven_models import relative_difference
from support.vocab_models import Losses, VocabModule, loader
from test_distributed_pytree import _state

HERE = Path(__file__).resolve().parent
WORKER = HERE / "outside_parts_worker.py"
START_S = 600  # 5 short fits of 2 processes, then 4 processes three times, on a loaded 2-core machine
STEPS = 3
PP2 = dict(balance=[2, 2], chunks=2, schedule="gpipe", checkpoint="never")
TWO = [
    dict(name=f"{model}_pp2", model=model, strategy=PP2) for model in ("llama", "gemma3", "bart", "qwen3_moe")
]
FOUR = [
    dict(name="llama_pp4", model="llama", strategy=dict(PP2, balance=[1, 1, 1, 1], chunks=4)),
    dict(name="llama_pp2_fsdp2", model="llama", strategy=dict(PP2, dp=2, data_parallel="fsdp")),
    # replicas that average after the step, under a schedule that splits each backward
    dict(
        name="llama_pp2_dp2_zbv",
        model="llama",
        strategy=dict(
            PP2, balance=[1, 1, 1, 1], virtual_stages=2, schedule="zbv_zero_bubble", chunks=4, dp=2
        ),
    ),
    # the model's own plan splits the layers, and the embedding and head over the vocabulary
    dict(
        name="llama_pp2_tp2",
        model="llama",
        strategy=dict(PP2, tensor_parallel=2, data_parallel="fsdp"),
        validate=True,
    ),
]
LAYOUTS = ["llama_pp4", "llama_pp2_fsdp2", "llama_pp2_tp2"]
# The Llama's parameters outside its layers, by the stages that read them.
LLAMA_OUTSIDE = {"model.embed_tokens.weight": "first", "model.norm.weight": "last", "lm_head.weight": "last"}


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> Iterator[Path]:
    yield ranks.launch(WORKER, 2, TWO, tmp_path_factory.mktemp("outside2"), within_s=START_S)


@pytest.fixture(scope="module")
def four(tmp_path_factory) -> Iterator[Path]:
    yield ranks.launch(WORKER, 4, FOUR, tmp_path_factory.mktemp("outside4"), within_s=START_S)


def _ranks(out: Path, name: str, world: int) -> List[Dict[str, Any]]:
    return [torch.load(out / f"{name}.rank{r}.pt", weights_only=True) for r in range(world)]


@functools.cache
def _trained(model: str) -> Tuple[Dict[str, torch.Tensor], List[float], float]:
    """The unpipelined model trained in this process on the same batches, its step losses, and its
    validation loss on them after."""
    module = VocabModule(model)
    losses = Losses()
    trainer = ranks.quiet_trainer("auto", 1, max_steps=STEPS, callbacks=[losses], limit_val_batches=3)
    trainer.fit(module, loader(model))
    validated = trainer.validate(module, loader(model), verbose=False)[0]["val_loss"]
    return {k: v.detach().clone() for k, v in module.model.state_dict().items()}, losses.losses, validated


def _reference(model: str) -> Dict[str, torch.Tensor]:
    return _trained(model)[0]


def _whole_parameter_bytes(model: str) -> int:
    return sum(p.numel() * p.element_size() for p in VocabModule(model).parameters())


@pytest.mark.slow
@pytest.mark.parametrize("run", [r["name"] for r in TWO])
def test_pipelined_training_equals_one_process_on_every_tensor_a_rank_holds(two, run) -> None:
    model = run.split("_pp")[0]
    want = _reference(model)
    for rank, saved in enumerate(_ranks(two, run, 2)):
        held = saved["trained"]
        assert held, f"rank {rank} holds nothing"
        assert relative_difference(held, {k: want[k] for k in held}) <= 1e-5, f"rank {rank}"


@pytest.mark.slow
@pytest.mark.parametrize("run", LAYOUTS)
def test_pp4_pp2_x_fsdp2_and_pp2_x_tp2_training_equals_one_process(four, run) -> None:
    want, losses, _ = _trained("llama")
    for rank, saved in enumerate(_ranks(four, run, 4)):
        held = saved["trained"]
        assert relative_difference(held, {k: want[k] for k in held}) <= 1e-5, f"rank {rank}"
        assert saved["losses"] == pytest.approx(losses, rel=1e-5, abs=0), f"rank {rank}"


@pytest.mark.slow
def test_replicas_under_a_zero_bubble_schedule_train_as_one_process(four) -> None:
    want, losses, _ = _trained("llama")
    for rank, saved in enumerate(_ranks(four, "llama_pp2_dp2_zbv", 4)):
        held = saved["trained"]
        assert relative_difference(held, {k: want[k] for k in held}) <= 1e-5, f"rank {rank}"
        assert saved["losses"] == pytest.approx(losses, rel=1e-5, abs=0), f"rank {rank}"


@pytest.mark.slow
@pytest.mark.parametrize("run", LAYOUTS)
def test_the_checkpoint_holds_every_key_once_and_loads_strictly_into_the_unpipelined_model(four, run) -> None:
    state = _state(four / f"{run}.ckpt")["state_dict"]
    module = VocabModule("llama")
    module.load_state_dict(state, strict=True)  # the embedding and head written by their stage alone
    trained = {k: v for r in _ranks(four, run, 4) for k, v in r["trained"].items()}
    assert relative_difference({k: v for k, v in module.model.state_dict().items()}, trained) == 0


@pytest.mark.slow
def test_the_llamas_embedding_is_held_by_its_first_stage_and_its_norm_and_head_by_its_last(two, four) -> None:
    for out, run, world, pp, tp in [
        (two, "llama_pp2", 2, 2, 1),
        (four, "llama_pp4", 4, 4, 1),
        (four, "llama_pp2_fsdp2", 4, 2, 1),
        (four, "llama_pp2_tp2", 4, 2, 2),
    ]:
        for rank, saved in enumerate(_ranks(out, run, world)):
            stage = rank // tp % pp  # tensor-parallel ranks innermost
            for key, where in LLAMA_OUTSIDE.items():
                expected = stage == 0 if where == "first" else stage == pp - 1
                assert (key in saved["trained"]) == expected, f"{run} rank {rank}: {key}"


@pytest.mark.slow
def test_every_layer_of_bart_and_gemma_is_held_once_and_the_tied_embedding_by_both_ends(two) -> None:
    bart = _ranks(two, "bart_pp2", 2)
    assert all("model.shared.weight" in r["trained"] for r in bart)  # encoder's and decoder's embedding
    assert "model.encoder.embed_positions.weight" not in bart[1]["trained"]
    assert "model.decoder.embed_positions.weight" not in bart[0]["trained"]
    gemma = _ranks(two, "gemma3_pp2", 2)
    assert all("model.embed_tokens.weight" in r["trained"] for r in gemma)  # tied to the head
    assert "model.norm.weight" not in gemma[0]["trained"]


@pytest.mark.slow
def test_per_rank_parameter_bytes_against_a_fair_share(two, four) -> None:
    """Measured on these runs (the figures the note quotes): held / (all parameters / ranks)."""
    whole = _whole_parameter_bytes("llama")
    share = {
        run: [r["held_bytes"] / (whole / world) for r in _ranks(out, run, world)]
        for out, run, world in [(two, "llama_pp2", 2), *((four, run, 4) for run in LAYOUTS)]
    }
    print({k: [round(x, 2) for x in v] for k, v in share.items()})
    # pp2: each end holds one of the two large matrices (embedding, head) and half the layers.
    assert max(share["llama_pp2"]) <= 1.15
    # pp4: the middle stages hold one small layer each; the ends one large matrix (2x a fair share:
    # a vocabulary matrix is half of this model, and pp alone cannot split it).
    assert max(share["llama_pp4"][1:3]) < 0.2 and max(share["llama_pp4"]) < 2.1
    # pp2 x fsdp2: the layers and the parts outside them sharded over the replicas.
    assert max(share["llama_pp2_fsdp2"]) <= 1.15
    # pp2 x tp2: the layers split by the model's plan, the embedding and head over the vocabulary.
    assert max(share["llama_pp2_tp2"]) <= 1.15


@pytest.mark.slow
def test_under_pp2_x_tp2_the_loss_is_computed_on_logits_split_over_the_vocabulary(four) -> None:
    """The last stage's step sees each micro-batch's logits as a DTensor of which each rank holds
    half the vocabulary (the loss parallel over it: engines/distributed/vocab_loss.py); a validation
    after the fit sees them whole, and its loss equals one process's."""
    _, _, validated = _trained("llama")
    for rank, saved in enumerate(_ranks(four, "llama_pp2_tp2", 4)):
        if rank // 2 == 1:
            assert saved["logits_seen"] == ("DTensor", (2, 8, 16000)), f"rank {rank}"
        assert saved["val_loss"] == pytest.approx(validated, rel=1e-5, abs=0), f"rank {rank}"


@pytest.mark.slow
def test_under_pp2_x_tp2_each_rank_holds_half_of_the_vocabulary_rows_of_its_stages_matrix(four) -> None:
    for rank, saved in enumerate(_ranks(four, "llama_pp2_tp2", 4)):
        key = "model.embed_tokens.weight" if rank // 2 == 0 else "lm_head.weight"  # tp innermost
        assert tuple(saved["local_shapes"][key]) == (16000, 128), f"rank {rank}: {key}"


@pytest.mark.slow
def test_a_step_that_mixes_the_split_logits_with_a_plain_tensor_is_refused_naming_the_fix(tmp_path) -> None:
    """Under pp2 x tp2 the step's logits are a DTensor split over the vocabulary: a step that compares
    them with its plain labels fails on the last stage with the fix named, not torch's bare error."""
    run = dict(FOUR[-1], name="reads_logits", reads_logits=True, validate=False)
    codes = ranks.exit_codes(WORKER, 4, [run], tmp_path, within_s=START_S)
    assert codes[2:] == [1, 1] and any(codes[:2]), codes  # the last stage's ranks raised, the rest stopped
    text = ranks.logs(tmp_path, 4)
    assert "VocabModule.training_step on the logits split over the vocabulary" in text
    assert "HINT: gather them where the step needs them whole (logits.full_tensor())" in text
