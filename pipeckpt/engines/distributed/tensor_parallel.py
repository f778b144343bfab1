"""Tensor parallelism inside a stage: each pipelined layer's weights split over the mesh's ``tp`` dimension.

Why a plan the engine applies (``tensor_parallel_plan``), not ``parallelize_module`` in the module's
``configure_model`` as under Lightning's ``ModelParallelStrategy``: a module built on the meta device
is made real stage by stage after ``configure_model``, and its initial values equal an eager build's
only if each weight is drawn whole and split afterwards. So the engine applies torch's own styles
(``ColwiseParallel``, ``RowwiseParallel``, through ``parallelize_module``) to the layers of this
rank's stages once they are real, and FSDP2 shards over ``dp`` on top (torchtitan's order). A module
whose every parameter a pretrained checkpoint fills once split is split on the meta device instead,
each rank allocating its slice alone (:func:`_parallelize`). A layer takes and returns plain
tensors, replicated over ``tp``: what crosses a stage boundary is unchanged.
A ``pipeline_of`` model without ``tensor_parallel_plan`` is split by its own plan (:mod:`.model_plan`),
so whether a plan is missing is known only with the model (:func:`layer_plan`), not from the settings.
Its embedding and head, outside the layers, are split over the vocabulary by the entries that name
them (:mod:`.vocab_plan`), in the same plan: paths in the model, not in a layer.
"""

import functools
from dataclasses import dataclass, replace
from fnmatch import fnmatch
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from pipeckpt._compat import own_tensors, set_own_tensor
from pipeckpt._errors import config_error
from pipeckpt.boundaries.pipeline_of import ModulePipeline
from pipeckpt.engines.distributed.model_plan import SPLITTABLE, matches, model_plan, split_by
from pipeckpt.engines.distributed.sequence_parallel import SequenceRoles, apply_hooks, sequence_roles
from pipeckpt.engines.distributed.sequence_parallel import styles as sequence_styles
from pipeckpt.engines.distributed.vocab_plan import outside_entries, outside_modules, own_outside_plan
from pipeckpt.settings import PipeSettings
from pipeckpt.weights.pretrained import pending_reads

__all__: List[str] = []

#: The plan's names for torch's styles: a Linear or Embedding split by output or by input features.
STYLES: Dict[str, Callable[[], ParallelStyle]] = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
#: The same names for a module outside the layers, split over the vocabulary (:mod:`.vocab_plan`): an
#: embedding's rows (its token ids replicated), a head's outputs (its logits gathered whole).
OUTSIDE_STYLES: Dict[str, Callable[[], ParallelStyle]] = {
    "colwise": lambda: ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
    "rowwise": lambda: RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
}
#: The model's output head (``get_output_embeddings()``) split by its outputs: its logits stay split
#: over the vocabulary, a DTensor, for the model's loss to be computed on (:mod:`.vocab_loss`).
LOGITS_SPLIT = lambda: ColwiseParallel(  # noqa: E731
    input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=False
)


def check_tensor_parallel(s: PipeSettings) -> None:
    """``tensor_parallel`` is a count; ``tensor_parallel_plan`` names styles, and only with it; the
    replicas shard (DDP does not take the split parameters). Whether ``tensor_parallel > 1`` needs a
    plan depends on the model (a ``pipeline_of`` model has its own): :func:`layer_plan` decides."""
    tp, plan = s.tensor_parallel, s.tensor_parallel_plan
    if tp is None:
        return
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise config_error(
            f"tensor_parallel={tp!r}",
            "the processes that split a pipeline rank's layers are an integer number >= 1",
            "set tensor_parallel >= 1 (1: no tensor parallelism)",
        )
    if plan is not None and not isinstance(plan, Mapping):
        raise config_error(
            f"tensor_parallel_plan={plan!r}",
            "maps a submodule path inside each pipelined layer to a style",
            "set for example tensor_parallel_plan={'mlp.up': 'colwise', 'mlp.down': 'rowwise'}",
        )
    bad = {k: v for k, v in (plan or {}).items() if not isinstance(k, str) or v not in STYLES}
    if bad:
        raise config_error(
            f"tensor_parallel_plan={dict(bad)!r}",
            f"each entry maps a submodule path (an fnmatch pattern) to one of {list(STYLES)}",
            "name each submodule's style as 'colwise' (split by output features) or 'rowwise' "
            "(split by input features; the one after a colwise)",
        )
    if tp == 1 and plan:
        raise config_error(
            f"tensor_parallel_plan with tensor_parallel={tp}",
            "a plan splits layers over the tensor-parallel processes, and there is one",
            "set tensor_parallel > 1, or drop tensor_parallel_plan",
        )
    sp = s.sequence_parallel
    if sp is not None and not isinstance(sp, bool):
        raise config_error(
            f"sequence_parallel={sp!r}", "is a switch: True or False", "set sequence_parallel=True or False"
        )
    if sp and tp == 1:
        raise config_error(
            f"sequence_parallel=True with tensor_parallel={tp}",
            "sequence parallelism splits the sequence over the tensor-parallel processes, and there is one",
            "set tensor_parallel > 1, or drop sequence_parallel",
        )
    if tp > 1 and s.data_parallel != "fsdp":
        raise config_error(
            f"tensor_parallel={tp} with data_parallel={s.data_parallel!r}",
            "DDP does not take tensor-parallel (DTensor) parameters; FSDP2 shards them over the "
            "replicas on the same mesh (with dp=1 too)",
            "set data_parallel='fsdp'",
        )


def under_fsdp(dp_shard: int, tp: int) -> bool:
    """Whether the engine wraps a stage in FSDP2: where it shards over the replicas, and under tensor
    parallelism at any shard degree (the check above: DDP does not take DTensor parameters), where a
    degree of 1 still gathers every parameter into a copy and reduces through FSDP2's buffers. The
    layout search's settings and cost model and the memory model read the rule here."""
    return dp_shard > 1 or tp > 1


def layer_plan(layers: nn.Sequential, s: PipeSettings) -> PipeSettings:
    """``s`` with the plan each pipelined layer of ``layers`` is split by: ``tensor_parallel_plan``
    (checked against the layers), else a ``pipeline_of`` model's own (:mod:`.model_plan`); an
    ``nn.Sequential`` has none of its own. Unchanged when ``tensor_parallel`` is 1."""
    if (s.tensor_parallel or 1) == 1:
        return s
    settled = _settled_plan(layers, s)
    if settled.sequence_parallel:
        check_sequence_parallel(layers, settled.tensor_parallel_plan or {})
    return settled


def _settled_plan(layers: nn.Sequential, s: PipeSettings) -> PipeSettings:
    tp, plan = s.tensor_parallel or 1, s.tensor_parallel_plan
    if plan:
        named_outside = _outside_patterns(layers, plan) if isinstance(layers, ModulePipeline) else set()
        check_plan(list(layers), {p: st for p, st in plan.items() if p not in named_outside})
        return s
    if isinstance(layers, ModulePipeline):
        return replace(s, tensor_parallel_plan={**model_plan(layers, tp), **own_outside_plan(layers)})
    raise config_error(
        f"tensor_parallel={tp} without tensor_parallel_plan",
        "tensor parallelism splits the submodules a plan names, and an nn.Sequential pipeline has no "
        "plan of its own (a pipeline_of model's is its config's base_model_tp_plan)",
        "set tensor_parallel_plan (docs/DISTRIBUTED.md, 'Tensor parallel'), or tensor_parallel=1",
    )


def check_sequence_parallel(layers: nn.Sequential, plan: Mapping[str, str]) -> None:
    """Sequence parallelism splits a ``pipeline_of`` model's layers, each of whose parts takes a role
    (:func:`.sequence_parallel.sequence_roles`, which refuses one that does not)."""
    if not isinstance(layers, ModulePipeline):
        raise config_error(
            f"sequence_parallel=True on an nn.Sequential pipeline ({type(layers[0]).__name__}, ...)",
            "sequence parallelism splits a layer's hidden state (batch, sequence, hidden) along the "
            "sequence, which it knows in a pipeline_of model's layers (transformers' decoder layers)",
            "pipeline the model with pipeline_of, or set sequence_parallel=False",
        )
    inside = {p: st for p, st in plan.items() if p in _inside_patterns(layers, plan)}
    for name, layer in zip(layers.names, layers):
        sequence_roles(layer, inside, name)


def _inside_patterns(spec: ModulePipeline, plan: Mapping[str, str]) -> Set[str]:
    """The patterns of ``plan`` that name a submodule inside some layer of ``spec``."""
    return {p for p in plan if any(matches(layer, p) for layer in spec)}


def _outside_patterns(spec: ModulePipeline, plan: Mapping[str, str]) -> Set[str]:
    """The patterns of ``plan`` that name no submodule inside a layer but a module outside the
    layers (by its path in the model), checked (:func:`.vocab_plan.outside_entries`)."""
    inside = _inside_patterns(spec, plan)
    outside_entries(spec, plan, inside)
    paths = list(outside_modules(spec))
    return {p for p in plan if p not in inside and any(fnmatch(path, p) for path in paths)}


def check_plan(layers: Sequence[nn.Module], plan: Mapping[str, str]) -> None:
    """Every pattern of ``plan`` names a Linear or Embedding inside some layer of ``layers`` (the
    whole pipelined Sequential, the same on every process): a typo would leave weights whole."""
    splittable = sorted(
        {n for layer in layers for n, m in layer.named_modules() if isinstance(m, SPLITTABLE)}
    )
    for pattern, style in plan.items():
        found = [(n, m) for layer in layers for n, m in matches(layer, pattern)]
        if not found:
            shown = ", ".join(splittable[:12]) + (", ..." if len(splittable) > 12 else "")
            raise config_error(
                f"tensor_parallel_plan entry {pattern!r}",
                "each pattern names submodules by their path inside a pipelined layer (e.g. "
                "'attn.q' for layer.attn.q), and this one names none",
                f"fix the path; the layers' Linear and Embedding submodules: {shown}",
            )
        wrong = [(n, type(m).__name__) for n, m in found if not isinstance(m, SPLITTABLE)]
        if wrong:
            raise config_error(
                f"tensor_parallel_plan entry {pattern!r}: {style!r} for {wrong[0][0]} ({wrong[0][1]})",
                "torch's colwise and rowwise styles split an nn.Linear or an nn.Embedding",
                "name the Linear or Embedding layers inside it",
            )


def check_whole(layers: Sequence[nn.Module]) -> None:
    """A layer the module split itself (its parameters are DTensors already) is refused: the engine
    splits each weight after making it real, and would split it twice."""
    split = [n for layer in layers for n, p in layer.named_parameters() if isinstance(p, DTensor)]
    if split:
        raise config_error(
            f"pipelined layers with parameters already distributed ({', '.join(split[:3])})",
            "under the pipeline the engine applies the tensor-parallel plan to each layer once it is "
            "real, after configure_model, so that initial values equal an eager build's",
            "give the plan as tensor_parallel_plan instead of calling parallelize_module yourself",
        )


@dataclass
class TensorParallel:
    """``plan`` applied over ``mesh`` (the mesh's ``tp`` dimension); with ``sequence``, sequence
    parallelism too (:mod:`.sequence_parallel`), ``ends`` the ids of the model's first and last
    pipelined layers (set by the build, which knows them)."""

    mesh: DeviceMesh
    plan: Dict[str, str]
    sequence: bool = False
    ends: Tuple[int, int] = (0, 0)

    @classmethod
    def of(cls, s: PipeSettings, mesh: Optional[DeviceMesh]) -> Optional["TensorParallel"]:
        """The tensor parallelism ``s`` asks for (``tensor_parallel > 1``) over ``mesh["tp"]``, or None
        (``s``'s plan: the one :func:`layer_plan` settled)."""
        if (s.tensor_parallel or 1) == 1:
            return None
        assert mesh is not None and s.tensor_parallel_plan is not None
        return cls(mesh["tp"], dict(s.tensor_parallel_plan), bool(s.sequence_parallel))

    def split(self, layers: Sequence[nn.Module]) -> None:
        """Each submodule of ``layers`` that the plan names, split in place (its parameters become
        DTensors on the ``tp`` mesh, from this rank's whole values)."""
        check_whole(layers)
        for layer in layers:
            styles: Dict[str, Any] = {
                name: STYLES[style]() for name, style in split_by(layer, self.plan).items()
            }
            roles: Optional[SequenceRoles] = None
            if self.sequence:
                roles = sequence_roles(layer, self.plan)
                styles.update(sequence_styles(roles, self.mesh))
            if styles:
                _parallelize(layer, self.mesh, styles)
            if roles is not None:
                first, last = (id(layer) == end for end in self.ends)
                apply_hooks(layer, roles, self.mesh, first=first, last=last)

    def split_outside(self, spec: ModulePipeline, held: Sequence[nn.Module]) -> bool:
        """The modules of ``held`` (outside ``spec``'s layers, this pipeline rank's alone) that the
        plan names, split over the vocabulary in place (:mod:`.vocab_plan`); whether the model's
        output head is among them (its logits then stay split: :mod:`.vocab_loss`)."""
        mine = {id(m) for m in held}
        entries = outside_entries(spec, self.plan, _inside_patterns(spec, self.plan))
        head = _output_head(spec.root)
        logits_split = False
        for path, style in entries.items():
            module = spec.root.get_submodule(path)
            if id(module) not in mine:
                continue
            if module is head and style == "colwise":
                _parallelize(module, self.mesh, LOGITS_SPLIT())
                logits_split = True
            else:
                _parallelize(module, self.mesh, OUTSIDE_STYLES[style]())
        return logits_split


def _parallelize(module: nn.Module, mesh: DeviceMesh, plan: Any) -> None:
    """``parallelize_module(module, mesh, plan)``, each rank's slices cut from tensor-parallel rank 0's
    whole values (scattered); or, where every parameter of ``module`` is read from a pretrained
    checkpoint once split (:func:`.pretrained.read_later`), split on the meta device and each rank's
    slice alone allocated, written by nothing before the read (torchtitan's order). Splitting the
    allocated whole instead cut each slice with a copy (``distribute_tensor`` clones it, with
    ``src_data_rank=None`` too), and FSDP2's ``fully_shard`` then copied that into its own padded
    shard: two written copies of the largest slice at once, the first left in glibc's heap when
    freed (benchmarks/RESULTS.md, "Under pp2 x tp2"). Receiving rank 0's slice, or sending it the
    whole, touched the same pages, all overwritten by the read."""
    later = pending_reads(module)
    slots = _parameter_slots(module)
    if not (later and all(id(p) in later for _, _, p in slots)):
        parallelize_module(module, mesh, plan, src_data_rank=0)
        return
    devices = {p.device for _, _, p in slots}
    assert len(devices) == 1, f"the parameters of a module split over tp on {devices}"
    was = _replace(slots, lambda p: p.to("meta"))  # nothing allocated or copied: read later
    parallelize_module(module, mesh, plan, src_data_rank=None)
    slots = _parameter_slots(module)
    _replace(slots, functools.partial(_allocated, device=devices.pop()), kept=was)


def _parameter_slots(module: nn.Module) -> List[Tuple[nn.Module, str, Tensor]]:
    """Every parameter of ``module`` where it is held: (owning submodule, name, parameter), a tied
    one once per owner."""
    return [(owner, n, p) for owner in module.modules() for n, p, is_param in own_tensors(owner) if is_param]


def _replace(
    slots: Sequence[Tuple[nn.Module, str, Tensor]],
    made: Callable[[Tensor], Tensor],
    kept: Sequence[Tuple[Tensor, Tensor]] = (),
) -> List[Tuple[Tensor, Tensor]]:
    """Each parameter in ``slots`` replaced by ``made(parameter)`` (a tie among the slots kept one), or
    by ``old`` where it is the ``new`` of a pair ``(new, old)`` of ``kept`` (a parameter the split
    left as it was gets its own tensor back); returns the pairs it made."""
    new: Dict[int, Tensor] = {}
    for owner, name, p in slots:
        if id(p) not in new:
            back = next((old for meta, old in kept if meta is p), None)
            new[id(p)] = back if back is not None else nn.Parameter(made(p.detach()), p.requires_grad)
        set_own_tensor(owner, name, new[id(p)], True)
    by_id = {id(p): p for _, _, p in slots}
    return [(made_p, by_id[i]) for i, made_p in new.items()]


def _allocated(t: Tensor, device: torch.device) -> Tensor:
    """The meta tensor ``t`` allocated on ``device`` (left unwritten): a DTensor, its local slice alone."""
    if not isinstance(t, DTensor):
        return torch.empty_like(t, device=device)
    local = torch.empty_like(t.to_local(), device=device)
    return DTensor.from_local(
        local, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
    )


def _output_head(root: nn.Module) -> Optional[nn.Module]:
    """The model's output head by its own account (transformers' ``get_output_embeddings``), if any."""
    found = getattr(root, "get_output_embeddings", None)
    head = found() if callable(found) else None
    return head if isinstance(head, nn.Linear) else None
