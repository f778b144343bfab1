"""Pipelining a module that has its own ``forward`` (not an ``nn.Sequential``).

``configure_pipeline()`` returns ``pipeline_of(self.model, "transformer.h")``: the module
whose ``forward`` is pipelined, and the names of its layers (a ``ModuleList`` or Sequential
names all its children; any other submodule is one layer). The layers, in that order,
are what ``stages``/``balance`` cut into stages, exactly as the layers of a Sequential.

Why layers by name rather than a traced graph (``torch.distributed.pipelining``'s
``pipeline(split_spec=...)``): the model's own ``forward`` keeps running as written,
Python control flow, masks built on the fly, ``ModelOutput`` and all, so nothing is
traced, nothing is rewritten and nothing is re-registered: ``state_dict`` keys stay
the model's own and a checkpoint loads ``strict=True`` into the unmodified model. A value
that one layer makes and a later stage uses (an encoder output read by every decoder
layer, a skip connection) needs no declaration: it is an ordinary argument of the later
layer's call. The engine runs the module's ``forward`` once per micro-batch; each call of
a named layer runs on its stage's device, under its stage's checkpoint mode (a
checkpointed layer keeps its inputs and recomputes itself in backward); what runs
outside the layers (embeddings, the final norm and head) runs on the last stage's device
and is never recomputed.
"""

from typing import List, Sequence, Tuple

from torch import nn

from pipeckpt._errors import config_error

__all__ = ["ModulePipeline", "pipeline_of"]


class ModulePipeline(nn.Sequential):
    """The layers of ``root`` that form the pipeline, in order; ``root``'s forward drives them.

    A Sequential of the user's own layer objects (never copies) so that planning, placing
    and reports treat it as any pipelined Sequential; it is not part of the user's module,
    so it adds no key to any ``state_dict``. It is never called as a chain."""

    root: nn.Module

    def __init__(self, root: nn.Module, names: Sequence[str], layers: Sequence[nn.Module]) -> None:
        super().__init__(*layers)
        self.__dict__["root"] = root  # not a child: the root is the user's, and holds these layers
        self.names: Tuple[str, ...] = tuple(names)

    def forward(self, *args: object, **kwargs: object) -> object:
        raise RuntimeError(
            "a ModulePipeline is not a chain of layers: call the module you passed to pipeline_of()"
        )


def _layer(module: nn.Module, name: str) -> nn.Module:
    try:
        return module.get_submodule(name)
    except AttributeError:
        near = [n for n, m in module.named_modules() if isinstance(m, (nn.ModuleList, nn.Sequential))][:6]
        raise config_error(
            f"pipeline_of(..., {name!r})",
            f"{type(module).__name__} has no submodule {name!r}",
            f"name a submodule as in named_modules(), e.g. one of its layer lists: {near}",
        ) from None


def pipeline_of(module: nn.Module, *layers: str) -> ModulePipeline:
    """The pipeline of ``module`` (called by your ``training_step`` as ``self.model(...)``)
    over the layers named in ``layers`` (``"transformer.h"``: all its children)."""
    if not isinstance(module, nn.Module):
        raise config_error(
            f"pipeline_of({type(module).__name__}, ...)",
            "the first argument is the module whose forward is pipelined",
            "pass your model, e.g. pipeline_of(self.model, 'transformer.h')",
        )
    if not layers:
        raise config_error(
            f"pipeline_of({type(module).__name__}) with no layers",
            "the pipeline needs the names of the layers to cut into stages",
            "name the layer list(s), e.g. pipeline_of(self.model, 'transformer.h')",
        )
    names: List[str] = []
    found: List[nn.Module] = []
    for name in layers:
        sub = _layer(module, name)
        if isinstance(sub, (nn.ModuleList, nn.Sequential)):
            names += [f"{name}.{key}" for key, _ in sub.named_children()]
            found += list(sub.children())
        else:
            names.append(name)
            found.append(sub)
    seen: dict = {}
    for name, layer in zip(names, found):
        if id(layer) in seen:
            raise config_error(
                f"pipeline_of(..., {', '.join(map(repr, layers))})",
                f"names the layer {name!r} twice (also as {seen[id(layer)]!r})",
                "name each layer once",
            )
        seen[id(layer)] = name
    if not found:
        raise config_error(
            f"pipeline_of(..., {', '.join(map(repr, layers))})",
            "names no layer (the lists are empty)",
            "name a list that holds the model's blocks",
        )
    return ModulePipeline(module, names, found)
