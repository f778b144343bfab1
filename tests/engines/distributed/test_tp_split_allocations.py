"""What a rank allocates when it splits over tensor parallelism the modules a pretrained checkpoint
fills once split (``weights.pretrained.read_later``): each rank's slice alone, written by nothing
before the read. Splitting the allocated whole instead made each rank write a copy of its slice
(torch's ``distribute_tensor`` clones it, with ``src_data_rank=None`` too), which FSDP2 then copied
again into its own shard: under pp2 x tp2 the ranks of a 0.168e9 Llama peaked 93-115 MiB over the
1.15 bound at train start (benchmarks/RESULTS.md, "Under pp2 x tp2"). Without processes: rank 0 of
a fake world of 2 (torch's ``FakeStore``), a tiny HF Llama built on the meta device, marked with
:func:`pipeckpt.pretrained` and made real with every read held back, as under FSDP; then split by
its own plan (the layers' projections, the embedding and head over the vocabulary) and read."""

from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import pytest
import torch
import torch.distributed as dist
import transformers
from support.pretrained_models import reference, save
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from pipeckpt import pipeline_of, pretrained
from pipeckpt._compat import TorchDispatchMode, tree_flatten
from pipeckpt.engines.distributed.tensor_parallel import TensorParallel, layer_plan
from pipeckpt.settings import PipeSettings
from pipeckpt.weights.pretrained import fill, in_checkpoint, read_later, reading_later

TP = 2


class Created(TorchDispatchMode):
    """Every storage an operator creates while it is on: (operator, bytes)."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: List[Tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        before = {id(t.untyped_storage()) for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)}
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, Tensor) and not t.is_meta and not isinstance(t, DTensor):
                st = t.untyped_storage()
                if st.nbytes() and id(st) not in before:
                    self.storages.append((str(func), st.nbytes()))
        return out


@pytest.fixture
def tp_mesh() -> Iterator[DeviceMesh]:
    """Rank 0 of a world of ``TP`` ranks in this process, its mesh's one dimension ``tp``."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=TP)
    try:
        yield init_device_mesh("cpu", (TP,), mesh_dim_names=("tp",))
    finally:
        dist.destroy_process_group()


def _filled_later(path: Path) -> Any:
    """The Llama of ``path`` built on meta and made real with every read held back (as a rank
    that shards its stages does: ``agreed_plan.materialize_mine``), nothing written into it."""
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(path))
    pretrained(model, path)
    with reading_later(in_checkpoint(model)):
        fill(model, torch.device("cpu"), None)
    return model


def test_a_rank_allocates_only_its_slice_of_what_the_checkpoint_fills_once_split_and_writes_none(
    tmp_path: Path, tp_mesh: DeviceMesh
) -> None:
    path = save("llama", tmp_path / "llama")
    model = _filled_later(path)
    spec = pipeline_of(model, "model.layers")
    plan = layer_plan(spec, PipeSettings(engine="distributed", tensor_parallel=TP, data_parallel="fsdp"))
    split = TensorParallel(tp_mesh, dict(plan.tensor_parallel_plan or {}))
    whole: Dict[str, int] = {k: v.numel() * v.element_size() for k, v in model.state_dict().items()}
    created = Created()
    with created:
        split.split(list(spec))
        assert split.split_outside(spec, [model.model.embed_tokens, model.lm_head])  # the logits stay split
    params = dict(model.named_parameters())
    local = {k: p.to_local() for k, p in params.items() if isinstance(p, DTensor)}
    assert len(local) == 4 * 7 + 2  # every projection of the 4 layers, the embedding and the head
    # an allocation of each split tensor's slice (and of the norms it leaves whole), nothing written:
    # splitting the whole wrote a clone of each slice (aten.clone), to be overwritten by the read
    written = [(op, n) for op, n in created.storages if not op.startswith("aten.empty")]
    assert not written, written
    largest = max(whole[k] for k in local)
    assert max(n for _, n in created.storages) <= largest // TP
    for key, t in local.items():
        assert t.numel() * t.element_size() == whole[key] // TP, key
    # the read fills each slice with its part of the checkpoint, bitwise what from_pretrained holds
    read_later(model)
    want = reference(path).state_dict()
    for key, p in params.items():
        if isinstance(p, DTensor):
            dim = p.placements[0].dim  # type: ignore[attr-defined]
            assert torch.equal(p.to_local(), want[key].chunk(TP, dim=dim)[0]), key
        else:
            assert torch.equal(p, want[key]), key
