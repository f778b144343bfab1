"""One rank of a tensor-parallel ``pipeline_of`` run, started by test_tp_pipeline_of.py beside it
(see tests/support/ranks.py).

Each run of the spec trains a tiny Hugging Face model (``model``: ``llama``, ``qwen2`` or
``gpt_neox``) through ``pipeline_of`` over its decoder layers under ``engine="distributed"`` with
``strategy`` (tensor parallelism from the model's own plan), 3 steps (the gradient clipped to
``clip`` by norm, if given) on this replica's rows of every batch: built eagerly from its config,
seeded (``build='scratch'``), or on the meta device and filled from the pretrained directory
``path`` (``build='pretrained'``). Each rank saves ``<run>_rank<r>.pt``: its stages, the keys it
read from the directory's shards and the bytes of the tensors (or slices) it read, and for each
tensor it holds for real its whole value (a DTensor gathered) and, for a DTensor, its local shard,
placements, mesh dimensions and this rank's coordinate on the mesh, at fit start and after training."""

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, Iterator, List

import lightning as L
import safetensors
import torch
import transformers
from support.pretrained_models import FromPretrained, HeldAtStart, keys_read
from support.ranks import quiet_trainer, serve
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

import pipeckpt
from pipeckpt import PipelineStrategy
from pipeckpt.weights.ranged_read import SafetensorsFile

VOCAB, LENGTH, BATCH, STEPS = 64, 12, 8, 3
CONFIGS = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}
#: Each model's decoder layers, the path ``pipeline_of`` takes.
LAYERS = {"llama": "model.layers", "qwen2": "model.layers", "gpt_neox": "gpt_neox.layers"}


def config(name: str) -> Any:
    """Hidden 64, 4 heads and 2 KV heads (2 and 1 per tensor-parallel rank), 4 layers. GPT-NeoX
    (the GPT of Megatron-LM's lineage: LayerNorm, a GELU MLP, a fused query-key-value projection
    whose columns are grouped by head) has no KV heads of its own: 4 heads, its residuals in
    sequence and its embedding tied to its head, as Megatron's GPT."""
    if name == "gpt_neox":
        return transformers.GPTNeoXConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=256, num_hidden_layers=4,
            num_attention_heads=4, max_position_embeddings=32, use_parallel_residual=False,
            tie_word_embeddings=True, attention_dropout=0.0, hidden_dropout=0.0, use_cache=False,
            bos_token_id=0, eos_token_id=0, pad_token_id=0,
        )  # fmt: skip
    return CONFIGS[name](
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, use_cache=False,
        attention_dropout=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip


def batches(padded: bool) -> List[Dict[str, Tensor]]:
    """HF's dicts; ``padded``: right padding of different lengths (labels -100 there), else every
    row whole, so that the replicas of a batch hold as many label tokens each."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(1, VOCAB, (BATCH, LENGTH), generator=g)
        lengths = (
            torch.randint(2, LENGTH + 1, (BATCH,), generator=g) if padded else torch.full((BATCH,), LENGTH)
        )
        mask = (torch.arange(LENGTH)[None, :] < lengths[:, None]).long()
        out.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return out


def rows(data: List[Dict[str, Tensor]], replica: int, dp: int) -> List[Dict[str, Tensor]]:
    share = BATCH // dp
    return [{k: v[replica * share : (replica + 1) * share] for k, v in b.items()} for b in data]


class FromScratch(L.LightningModule):
    """HF ``name`` built from :func:`config`, seeded, pipelined over its decoder layers."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        torch.manual_seed(7)
        self.model = transformers.AutoModelForCausalLM.from_config(config(name)).train()

    def configure_pipeline(self) -> nn.Module:
        return pipeckpt.pipeline_of(self.model, LAYERS[self.name])

    def training_step(self, batch: Dict[str, Tensor], batch_idx: int) -> Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def held(module: nn.Module) -> Dict[str, Dict[str, Any]]:
    """Each tensor held for real: whole, and for a DTensor its shard and layout."""
    out: Dict[str, Dict[str, Any]] = {}
    for k, v in module.state_dict().items():
        if isinstance(v, DTensor):
            mesh = v.device_mesh
            out[k] = dict(
                whole=v.full_tensor().detach().clone(),
                local=v.to_local().detach().clone(),
                placements=[repr(p) for p in v.placements],
                mesh=list(mesh.mesh_dim_names or ()),
                sizes=list(mesh.shape),
                coordinate=list(mesh.get_coordinate() or ()),
            )
        elif not v.is_meta:
            out[k] = dict(whole=v.detach().clone())
    return out


@contextmanager
def bytes_read() -> Iterator[List[int]]:
    """The bytes of every tensor read (whole, or a slice's), in the file's dtype: by plain reads
    (pipeckpt.weights.ranged_read), or through ``safetensors.safe_open``."""
    counted: List[int] = []
    original = safetensors.safe_open
    ranged = SafetensorsFile.read_into

    def read_into(self: SafetensorsFile, dest: Tensor, key: str, offset: Any) -> None:
        itemsize = {"F32": 4, "BF16": 2, "F16": 2}[self.entries[key]["dtype"]]
        counted.append(dest.numel() * itemsize)
        ranged(self, dest, key, offset)

    class Slice:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def __getitem__(self, index: Any) -> Tensor:
            t = self.inner[index]
            counted.append(t.numel() * t.element_size())
            return t

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

    class Counting:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.inner = original(*args, **kwargs)

        def __enter__(self) -> "Counting":
            self.inner.__enter__()
            return self

        def __exit__(self, *exc: Any) -> Any:
            return self.inner.__exit__(*exc)

        def get_tensor(self, key: str) -> Tensor:
            t = self.inner.get_tensor(key)
            counted.append(t.numel() * t.element_size())
            return t

        def get_slice(self, key: str) -> Slice:
            return Slice(self.inner.get_slice(key))

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

    safetensors.safe_open = Counting
    SafetensorsFile.read_into = read_into  # type: ignore[method-assign]
    try:
        yield counted
    finally:
        safetensors.safe_open = original
        SafetensorsFile.read_into = ranged  # type: ignore[method-assign]


def run(spec: Dict[str, Any], out: str, world: int) -> None:
    settings = spec["strategy"]
    strategy = PipelineStrategy(engine="distributed", **settings)
    at_start = HeldAtStart(held)
    clip = spec.get("clip")
    trainer = quiet_trainer(strategy, world, max_steps=STEPS, gradient_clip_val=clip, callbacks=[at_start])
    if spec["build"] == "pretrained":
        module: L.LightningModule = FromPretrained(spec["model"], Path(spec["path"]), build="meta")
    else:
        module = FromScratch(spec["model"])
    dp = settings.get("dp", 1)
    replica = int(os.environ["LOCAL_RANK"]) // (world // dp)  # the mesh's outermost dimension
    data = DataLoader(rows(batches(spec["padded"]), replica, dp), batch_size=None)
    torch.manual_seed(123)
    with keys_read() as read, bytes_read() as counted:
        trainer.fit(module, data)
    result = dict(
        stages=[stage.index for stage in strategy.stages],
        read=sorted(read),
        bytes_read=sum(counted),
        at_start=at_start.held,
        trained=held(module.model),
    )
    torch.save(result, Path(out) / f"{spec['name']}_rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    serve(run)
