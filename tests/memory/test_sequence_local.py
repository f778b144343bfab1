"""What one tensor-parallel rank keeps for backward under sequence parallelism, as the memory model
profiles it (:mod:`pipeckpt.memory.sequence_local`: a layer cut to one rank, its sequence parts made
by hooks in one process) against the engine's own styles (:mod:`pipeckpt.engines.distributed.
sequence_parallel`, torch's ``SequenceParallel`` and DTensor's redistributions) on rank 0 of a fake
world of 2 (torch's ``FakeStore``: each collective gives its output's shape). HF Llama and GPT-NeoX,
every storage that autograd saves in a forward counted once (weights included): equal, byte for
byte, and less than tensor parallelism alone keeps."""

from typing import Any, Dict, Iterator, Tuple

import pytest
import torch
import transformers
from support.fake_world import fake_world
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from pipeckpt import pipeline_of
from pipeckpt.engines.distributed.model_plan import model_plan
from pipeckpt.engines.distributed.sequence_parallel import end_ids
from pipeckpt.engines.distributed.tensor_parallel import TensorParallel
from pipeckpt.memory.sequence_local import one_rank_sequence
from pipeckpt.memory.tp_local import cut_to_one_rank

TP, BATCH, LENGTH = 2, 2, 16
#: Each model's config and decoder layers; each is split by its own plan (config.base_model_tp_plan).
MODELS: Dict[str, Tuple[Any, str]] = {
    "llama": (
        transformers.LlamaConfig(
            vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, use_cache=False,
        ),
        "model.layers",
    ),
    "gpt_neox": (
        transformers.GPTNeoXConfig(
            vocab_size=64, hidden_size=64, intermediate_size=256, num_hidden_layers=3,
            num_attention_heads=4, use_parallel_residual=False, use_cache=False,
        ),
        "gpt_neox.layers",
    ),
}  # fmt: skip


@pytest.fixture
def tp_mesh() -> Iterator[DeviceMesh]:
    with fake_world(TP) as mesh:
        yield mesh


def _model(name: str) -> Tuple[Any, Any, Dict[str, str]]:
    config, layers = MODELS[name]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    spec = pipeline_of(model, layers)
    return model, spec, model_plan(spec, TP)


def _saved_bytes(model: Any) -> int:
    """The bytes of every storage autograd saves in one forward of ``model`` (a DTensor's local)."""
    storages: Dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        local = t.to_local() if isinstance(t, DTensor) else t
        st = local.untyped_storage()
        storages[st.data_ptr()] = st.nbytes()
        return t

    ids = torch.randint(0, 64, (BATCH, LENGTH), generator=torch.Generator().manual_seed(1))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids)
    return sum(storages.values())


@pytest.mark.parametrize("name", list(MODELS))
def test_the_profiles_sequence_parts_keep_what_the_engines_styles_keep(tp_mesh, name):
    engine, spec, plan = _model(name)
    split = TensorParallel(tp_mesh, plan, sequence=True, ends=end_ids(spec))
    split.split(list(spec))
    profiled, cut, _ = _model(name)
    cut_to_one_rank(cut, plan, TP)
    one_rank_sequence(cut, plan, TP)
    assert _saved_bytes(profiled) == _saved_bytes(engine)


@pytest.mark.parametrize("name", list(MODELS))
def test_sequence_parallelism_keeps_less_than_tensor_parallelism_alone(name):
    sequence, cut, plan = _model(name)
    cut_to_one_rank(cut, plan, TP)
    one_rank_sequence(cut, plan, TP)
    alone, cut_alone, _ = _model(name)
    cut_to_one_rank(cut_alone, plan, TP)
    assert _saved_bytes(sequence) < _saved_bytes(alone)
