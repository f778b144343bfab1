"""Tensor parallelism over the vocabulary for a ``pipeline_of`` model's parts outside its layers.

Why: for the models people have the input embedding and the LM head are the largest tensors of the
model, and each is held by one pipeline stage (:mod:`.outside_parts`); split over the ``tp`` ranks
by their vocabulary rows, each rank holds ``1/tp`` of them, as torchtitan and Hugging Face's own
tensor parallelism do. Both splits compute exactly what the whole module computes:

- an ``nn.Embedding`` split ``rowwise`` (its weight by rows, the token ids replicated) looks up the
  rows a rank holds and zeros for the rest, and the ranks' lookups are summed: one value and zeros;
- an ``nn.Linear`` split ``colwise`` (its weight by output features, the vocabulary) computes each
  logit on the rank that holds its row; the logits are gathered whole over ``tp`` for the model's own
  code (its loss, the step's output), so whatever reads them reads the same numbers.

Which modules: the entries of ``tensor_parallel_plan`` that name a module outside the layers by its
path in the model passed to ``pipeline_of`` (``{"model.embed_tokens": "rowwise", "lm_head":
"colwise"}``); without ``tensor_parallel_plan``, the model's own plan (transformers' ``tp_plan``:
``"embedding_rowwise"`` for the input embedding, ``"colwise_gather_output"`` for the head), whose
other styles outside the layers are left whole. A weight two modules share (a head tied to the
embedding) is summed whole across the stages that hold it (:mod:`.ties`), so it is not split: the
model's own plan leaves it whole, and a plan entry naming it is refused.
"""

from fnmatch import fnmatch
from typing import Dict, List, Mapping, Set, Tuple

from torch import nn

from pipeckpt._errors import config_error
from pipeckpt.boundaries.pipeline_of import ModulePipeline

__all__: List[str] = []

#: The model's own styles (transformers' names) that split a module outside the layers over the
#: vocabulary, as the plain style the engine applies, by the module type they split.
OWN_STYLES: Dict[str, Tuple[str, type]] = {
    "embedding_rowwise": ("rowwise", nn.Embedding),
    "colwise_gather_output": ("colwise", nn.Linear),
    "colwise_rep": ("colwise", nn.Linear),
    "colwise": ("colwise", nn.Linear),
}
#: The plain style that splits each module type over the vocabulary (its rows, or output features).
VOCAB_STYLE: Dict[type, str] = {nn.Embedding: "rowwise", nn.Linear: "colwise"}


def outside_modules(spec: ModulePipeline) -> Dict[str, nn.Module]:
    """The modules of ``spec``'s model outside its layers (neither a layer, inside one, nor one of
    their ancestors), by their path in the model."""
    layers = {id(m) for layer in spec for m in layer.modules()}
    around: Set[int] = set()
    for name in spec.names:
        module = spec.root
        around.add(id(module))
        for part in name.split("."):
            module = getattr(module, part)
            around.add(id(module))
    return {n: m for n, m in spec.root.named_modules() if n and id(m) not in layers | around}


def _shared(spec: ModulePipeline) -> Set[int]:
    """Ids of the modules whose own parameters another module holds too (a tie)."""
    holders: Dict[int, List[int]] = {}
    for m in spec.root.modules():
        for p in m.parameters(recurse=False):
            holders.setdefault(id(p), []).append(id(m))
    return {m for found in holders.values() if len(found) > 1 for m in found}


def own_outside_plan(spec: ModulePipeline) -> Dict[str, str]:
    """The entries of the model's own plan (transformers' ``tp_plan``) that split a module outside
    the layers over the vocabulary, as plain styles; a tied module's are left out (it stays whole)."""
    given = getattr(spec.root, "tp_plan", None)
    if not isinstance(given, Mapping):
        return {}
    outside, tied = outside_modules(spec), _shared(spec)
    plan: Dict[str, str] = {}
    for pattern, style in given.items():
        if style not in OWN_STYLES:
            continue
        plain, kind = OWN_STYLES[style]
        for path, module in outside.items():
            if fnmatch(path, pattern) and isinstance(module, kind) and id(module) not in tied:
                plan.setdefault(path, plain)
    return plan


def outside_entries(spec: ModulePipeline, plan: Mapping[str, str], inside: Set[str]) -> Dict[str, str]:
    """The entries of a user's ``plan`` that name modules outside ``spec``'s layers (those not in
    ``inside``, the patterns that name a submodule of a layer), checked: each names an embedding
    split ``rowwise`` or a linear head split ``colwise``, whose weight no other module shares."""
    outside, tied = outside_modules(spec), _shared(spec)
    found: Dict[str, str] = {}
    for pattern, style in plan.items():
        if pattern in inside:
            continue
        named = [(p, m) for p, m in outside.items() if fnmatch(p, pattern)]
        for path, module in named:
            kind = next((t for t in VOCAB_STYLE if isinstance(module, t)), None)
            if kind is None or VOCAB_STYLE[kind] != style:
                raise config_error(
                    f"tensor_parallel_plan entry {pattern!r}: {style!r} for {path} ({type(module).__name__})",
                    "outside the pipelined layers the plan splits a module over the vocabulary only: an "
                    "nn.Embedding by 'rowwise' (its rows) or an nn.Linear head by 'colwise' (its outputs)",
                    "name the input embedding as 'rowwise' and the LM head as 'colwise', or drop the entry",
                )
            if id(module) in tied:
                raise config_error(
                    f"tensor_parallel_plan entry {pattern!r} for {path}",
                    "its weight is tied to another module's (the head to the input embedding), and a "
                    "tied weight is summed whole across the stages that hold it, so it is not split",
                    "drop the entry (the tied weight stays whole on each tensor-parallel rank), or untie "
                    "the weights (tie_word_embeddings=False) to split both",
                )
            found[path] = style
    return found
