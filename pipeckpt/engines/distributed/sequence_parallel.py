"""Sequence parallelism: under tensor parallelism, a layer's residual stream split along the sequence.

Why: with the plain styles alone (:mod:`.tensor_parallel`) every tensor-parallel rank holds the
residual stream whole, ``b x s x h``: each layer's input, its norms' inputs and outputs, and, under
recompute, the input every layer keeps. Megatron-LM's sequence parallelism (Korthikanti et al.,
2022), which torchtitan applies with torch's own styles, keeps those ``1/tp`` each along the
sequence and swaps each block's all-reduce for a reduce-scatter after it and an all-gather before
the next: the same bytes on the wire. Here, with torch's styles and DTensor's redistributions:

- each norm of a layer (a child of the layer with parameters and none of the plan's) is torch's
  ``SequenceParallel``: it runs on this rank's part of the sequence, its weights replicated, so
  their gradients are summed over the ranks;
- each child holding the plan's ``colwise`` modules (attention, the MLP) has its input gathered
  whole before it, kept a DTensor until the colwise projections take it, so that its gradient is
  reduce-scattered back (each rank's heads give a part of it);
- each ``rowwise`` module reduce-scatters its output along the sequence (``output_layouts=Shard``);
- the model's first pipelined layer takes its input's part of the sequence, and its last gathers its
  output whole, so that what is outside the layers (the embedding, the final norm, the head) is as
  without sequence parallelism. What crosses a stage boundary is this rank's part, ``1/tp`` of it.

The roles are found from the plan and the layer (:func:`sequence_roles`), the same for the memory
model (:mod:`pipeckpt.memory.sequence_local`), which runs one rank's shapes. A layer whose children do
not fall into them (a child with parameters the plan does not split that is not a norm, a dropout in
the residual stream) is refused before any work: its numbers would change.
"""

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import RowwiseParallel, SequenceParallel

from pipeckpt._errors import config_error
from pipeckpt.engines.distributed.model_plan import split_by

__all__: List[str] = []

#: The sequence dimension of a layer's hidden state, ``(batch, sequence, hidden)`` (transformers').
SEQUENCE_DIM = 1


@dataclass(frozen=True)
class SequenceRoles:
    """What sequence parallelism does to each part of one layer, by path inside it."""

    norms: Tuple[str, ...]  # children run on this rank's part of the sequence, weights replicated
    gathered: Tuple[str, ...]  # children whose input is gathered whole (they hold colwise modules)
    scattered: Tuple[str, ...]  # rowwise modules, whose outputs are reduce-scattered


def sequence_roles(layer: nn.Module, plan: Mapping[str, str], name: str = "layer") -> SequenceRoles:
    """The roles of ``layer``'s parts under ``plan`` (the plan's entries inside a layer); refused,
    naming the part of ``name`` (the layer's path in the model), where a part has none of them."""
    split = split_by(layer, dict(plan))
    gathered = sorted({path.split(".")[0] for path, style in split.items() if style == "colwise"})
    scattered = tuple(sorted(path for path, style in split.items() if style == "rowwise"))
    norms: List[str] = []
    own = [n for n, _ in layer.named_parameters(recurse=False)]
    if own:
        _refuse(name, own[0], "a parameter of the layer itself", "it is not inside a norm or a split block")
    for child, module in layer.named_children():
        if child in gathered:
            continue
        params = list(module.parameters())
        if isinstance(module, nn.Dropout) and module.p > 0:
            _refuse(
                name, child, f"{type(module).__name__}(p={module.p})",
                "each rank would draw its own mask over its part of the sequence, not the "
                "unpipelined model's",
            )  # fmt: skip
        if not params:
            continue
        if any(path.split(".")[0] == child for path in split) or any(p.dim() != 1 for p in params):
            _refuse(
                name, child, type(module).__name__,
                "it holds parameters that are not a norm's (one weight and bias per feature) and "
                "is not a block whose input the plan's colwise modules take",
            )  # fmt: skip
        norms.append(child)
    return SequenceRoles(tuple(norms), tuple(gathered), scattered)


def _refuse(layer: str, part: str, what: str, why: str) -> None:
    raise config_error(
        f"sequence_parallel=True on {layer}.{part} ({what})",
        "sequence parallelism runs each layer's norms and residual stream on one rank's part of "
        f"the sequence, and gathers the input of each block the plan splits; {why}",
        "set sequence_parallel=False (tensor parallelism alone keeps the residual stream whole)",
    )


def styles(roles: SequenceRoles, mesh: DeviceMesh) -> Dict[str, Any]:
    """torch's styles for the norms and the rowwise modules under sequence parallelism (the colwise
    ones keep theirs: their input arrives whole, as a DTensor)."""
    out: Dict[str, Any] = {
        n: SequenceParallel(sequence_dim=SEQUENCE_DIM, use_local_output=True) for n in roles.norms
    }
    out.update({n: RowwiseParallel(output_layouts=Shard(SEQUENCE_DIM)) for n in roles.scattered})
    return out


def apply_hooks(layer: nn.Module, roles: SequenceRoles, mesh: DeviceMesh, *, first: bool, last: bool) -> None:
    """Each gathered child of ``layer`` takes its input whole (a DTensor, :func:`_gather`); the
    model's ``first`` layer takes its input's part of the sequence, its ``last`` gives its output
    whole."""
    for child in roles.gathered:
        layer.get_submodule(child).register_forward_pre_hook(
            on_hidden(lambda x: _gather(x, mesh)), with_kwargs=True
        )
    if first:
        layer.register_forward_pre_hook(on_hidden(lambda x: _part(x, mesh)), with_kwargs=True)
    if last:
        layer.register_forward_hook(on_output(lambda y: _whole(y, mesh)))


def _gather(x: Tensor, mesh: DeviceMesh) -> Tensor:
    """This rank's part of the sequence as the whole, a DTensor (Replicate) whose gradient, Partial
    from each rank's colwise projections, is reduce-scattered back."""
    part = (
        x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, (Shard(SEQUENCE_DIM),), run_check=False)
    )
    return part.redistribute(mesh, (Replicate(),))


def _part(x: Tensor, mesh: DeviceMesh) -> Tensor:
    """The whole hidden state (the same on every rank) as this rank's part of the sequence; its
    gradient is gathered whole."""
    check_divides(x, mesh.size())
    whole = DTensor.from_local(x, mesh, (Replicate(),), run_check=False)
    return whole.redistribute(mesh, (Shard(SEQUENCE_DIM),)).to_local()


def _whole(y: Tensor, mesh: DeviceMesh) -> Tensor:
    """This rank's part of the layer's output gathered whole (its gradient: this rank's part)."""
    return DTensor.from_local(y, mesh, (Shard(SEQUENCE_DIM),), run_check=False).full_tensor()


def check_divides(x: Tensor, tp: int) -> None:
    """Each of ``tp`` ranks holds an equal part of every sequence of the hidden state ``x``."""
    if x.dim() <= SEQUENCE_DIM or x.shape[SEQUENCE_DIM] % tp:
        raise config_error(
            f"sequence_parallel=True with a hidden state of shape {tuple(x.shape)} over tensor_parallel={tp}",
            "each tensor-parallel rank holds an equal part of every sequence (dimension 1 of "
            "(batch, sequence, hidden))",
            f"pad the sequences to a multiple of {tp} tokens, or set sequence_parallel=False",
        )


def on_hidden(change: Callable[[Tensor], Tensor]) -> Any:
    """A forward pre-hook (``with_kwargs=True``) that replaces a layer's or block's hidden state
    (the first positional tensor, else the ``hidden_states`` keyword) by ``change(it)``; the engine's
    and the memory model's (:mod:`pipeckpt.memory.sequence_local`)."""

    def hook(module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Optional[Tuple[Any, Any]]:
        if args and isinstance(args[0], Tensor):
            return (change(args[0]), *args[1:]), kwargs
        if isinstance(kwargs.get("hidden_states"), Tensor):
            return args, {**kwargs, "hidden_states": change(kwargs["hidden_states"])}
        raise TypeError(f"{type(module).__name__} was called without a hidden state to split by sequence")

    return hook


def on_output(change: Callable[[Tensor], Tensor]) -> Any:
    """A forward hook that replaces a layer's output hidden state (the output, or the first of a
    tuple led by one) by ``change(it)``; the engine's and the memory model's."""

    def hook(module: nn.Module, args: Any, output: Any) -> Any:
        if isinstance(output, Tensor):
            return change(output)
        if isinstance(output, tuple) and output and isinstance(output[0], Tensor):
            return (change(output[0]), *output[1:])
        raise TypeError(f"{type(module).__name__} returned {type(output).__name__}, not a hidden state")

    return hook


def end_ids(layers: nn.Sequential) -> Tuple[int, int]:
    """The ids of a model's first and last pipelined layers."""
    return id(layers[0]), id(layers[-1])
