"""A ``pipeline_of`` model's own tensor-parallel plan, in the terms of its pipelined layers.

Why: a Hugging Face model states how its base model splits (``config.base_model_tp_plan``, e.g.
Llama's ``{"layers.*.self_attn.q_proj": "colwise", ..., "layers.*.mlp.down_proj": "rowwise"}``), so a
user who pipelines it with ``pipeline_of`` need not write the plan again. The engine applies a plan
per pipelined layer (:mod:`.tensor_parallel`), so each entry is cut at the layer: the part of its
pattern that names the layer's path inside the base model is dropped, the rest is the submodule path
inside the layer. The rule:

- an entry that names a submodule inside a pipelined layer is used, if its style is one torch offers
  plainly (``colwise``, ``rowwise``); any other style there (``replicated_with_grad_allreduce``,
  ``packed_colwise``, the MoE styles) is refused: it needs a collective or a layout these two do not
  give, and leaving it out while splitting its neighbours would compute other numbers;
- an entry outside the pipelined layers (embeddings, the final norm, and the LM head of the model's
  own plan) is not a layer's: :mod:`.vocab_plan` splits the embedding and head over the vocabulary;
- every pipelined layer must be split by the same entries (the plan is one per layer).
"""

from fnmatch import fnmatch
from typing import Dict, List, Mapping, Optional, Tuple

from torch import nn

from pipeckpt._errors import config_error
from pipeckpt.boundaries.pipeline_of import ModulePipeline

__all__: List[str] = []

#: The styles a model's plan may use inside a pipelined layer (torch's, as the engine applies them).
PLAIN = ("colwise", "rowwise")
#: What torch's colwise and rowwise styles split.
SPLITTABLE = (nn.Linear, nn.Embedding)


def model_plan(spec: ModulePipeline, tp: int) -> Dict[str, str]:
    """The plan that splits each of ``spec``'s layers, from its root's ``config.base_model_tp_plan``
    (the module rule above); refused when there is none, or it names nothing inside the layers."""
    root = spec.root
    what = f"tensor_parallel={tp} with pipeline_of({type(root).__name__}, ...) and no tensor_parallel_plan"
    config = getattr(root, "config", None)
    given = getattr(config, "base_model_tp_plan", None)
    if not isinstance(given, Mapping) or not given:
        raise config_error(
            what,
            "without tensor_parallel_plan the layers are split by the model's own plan "
            f"(config.base_model_tp_plan), and {type(root).__name__} has none",
            "set tensor_parallel_plan={submodule path inside a layer: 'colwise' | 'rowwise'} "
            "(docs/DISTRIBUTED.md, 'Tensor parallel with pipeline_of'), or tensor_parallel=1",
        )
    _check_heads(config, tp)
    base = getattr(root, "base_model", root)  # the module the config's plan is written for
    paths = {id(m): n for n, m in base.named_modules() if n}
    per_layer: List[Tuple[str, nn.Module, Dict[str, str]]] = []
    for name, layer in zip(spec.names, spec):
        path = paths.get(id(layer))
        inner = _inside(path, given) if path is not None else {}
        per_layer.append((name, layer, {p: s for p, s in inner.items() if matches(layer, p)}))
    plan: Dict[str, str] = {}
    for _, _, inner in per_layer:
        for pattern, style in inner.items():
            plan.setdefault(pattern, style)
    for name, layer, inner in per_layer:
        _check_layer(name, layer, inner, plan)
    if not plan:
        raise config_error(
            what,
            "the model's own plan (config.base_model_tp_plan) names no submodule inside the "
            f"pipelined layers: {dict(given)}",
            "set tensor_parallel_plan naming the submodules inside a layer, or tensor_parallel=1",
        )
    return plan


def _check_heads(config: object, tp: int) -> None:
    """The attention heads divide among the ``tp`` ranks: HF's attention reshapes a colwise
    projection's local columns into ``-1`` heads of ``head_dim``, so each rank must hold whole heads."""
    for field in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, field, None)
        if isinstance(heads, int) and heads % tp:
            raise config_error(
                f"tensor_parallel={tp} with {field}={heads}",
                "the model's plan splits the attention projections by heads, so each tensor-parallel "
                "rank holds a whole number of them",
                f"set tensor_parallel to a divisor of {heads}",
            )


def _inside(path: str, given: Mapping[str, str]) -> Dict[str, str]:
    """The entries of ``given`` that reach inside the layer at ``path`` (in the base model), as
    patterns relative to it. HF's ``*`` stands for one component, so patterns match component-wise."""
    parts = path.split(".")
    found: Dict[str, str] = {}
    for pattern, style in given.items():
        pieces = pattern.split(".")
        if len(pieces) > len(parts) and all(fnmatch(p, q) for p, q in zip(parts, pieces)):
            found[".".join(pieces[len(parts) :])] = style
    return found


def matches(layer: nn.Module, pattern: str) -> List[Tuple[str, nn.Module]]:
    """The submodules of ``layer`` (by their path inside it) that ``pattern`` names."""
    return [(n, m) for n, m in layer.named_modules() if n and fnmatch(n, pattern)]


def split_by(layer: nn.Module, plan: Mapping[str, str]) -> Dict[str, str]:
    """Each submodule of ``layer`` that ``plan`` names, with its style: the first entry that names it
    (what :meth:`.tensor_parallel.TensorParallel.split` applies)."""
    out: Dict[str, str] = {}
    for pattern, style in plan.items():
        for n, _ in matches(layer, pattern):
            out.setdefault(n, style)
    return out


def _check_layer(name: str, layer: nn.Module, own: Dict[str, str], plan: Dict[str, str]) -> None:
    """``layer`` (named ``name``) split by ``plan`` exactly as its own entries ``own`` split it, each
    by a plain style, each a Linear or an Embedding."""
    odd = {p: s for p, s in own.items() if s not in PLAIN}
    if odd:
        pattern, style = next(iter(odd.items()))
        raise config_error(
            f"the model's tensor-parallel plan (config.base_model_tp_plan) splits {name}.{pattern} "
            f"as {style!r}",
            f"inside a pipelined layer only torch's plain styles {list(PLAIN)} are applied; "
            f"{style!r} needs a collective or a layout they do not give, and splitting the rest "
            "without it would change the numbers",
            "set tensor_parallel_plan yourself (colwise/rowwise pairs whose other parameters need "
            "no reduction over the tensor-parallel ranks), or tensor_parallel=1",
        )
    mine, applied = split_by(layer, own), split_by(layer, plan)
    if mine != applied:
        extra = sorted(set(applied.items()) ^ set(mine.items()))
        raise config_error(
            f"the model's tensor-parallel plan (config.base_model_tp_plan) on {name}",
            "the engine applies one plan to every pipelined layer, and the model's splits this layer "
            f"differently from the others ({extra[0][0]!r} as {extra[0][1]!r} in one and not the other)",
            "set tensor_parallel_plan yourself, or pipeline only layers the model's plan splits alike",
        )
    wrong: Optional[Tuple[str, str]] = next(
        ((n, type(m).__name__) for p in own for n, m in matches(layer, p) if not isinstance(m, SPLITTABLE)),
        None,
    )
    if wrong is not None:
        raise config_error(
            f"the model's tensor-parallel plan (config.base_model_tp_plan) on {name}.{wrong[0]} ({wrong[1]})",
            "torch's colwise and rowwise styles split an nn.Linear or an nn.Embedding",
            "set tensor_parallel_plan yourself naming the Linear layers, or tensor_parallel=1",
        )
