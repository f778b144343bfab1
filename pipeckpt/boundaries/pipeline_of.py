"""Pipelining a module that has its own ``forward`` (not an ``nn.Sequential``).

``pipeline_of(self.model, "transformer.h")`` names the module whose ``forward`` is pipelined and its
layers, which ``stages``/``balance`` cut into stages as the layers of a Sequential. Why layers by name
and not a traced graph (``torch.distributed.pipelining``'s ``pipeline(split_spec=...)``): the model's
own ``forward`` keeps running as written (control flow, masks, ``ModelOutput``), nothing is
re-registered, so ``state_dict`` keys stay the model's own, and a value one layer makes and a later
stage uses is an ordinary argument. What runs where: docs/DESIGN.md, boundaries/pipeline_of.
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
    """The pipeline of ``module`` over the layers named in ``layers``: what ``configure_pipeline()``
    returns for a model with its own ``forward``.

    Args:
        module: the model whose ``forward`` is pipelined; your ``training_step`` calls it as usual
            (``self.model(ids, ...)``), with the batch's tensors in its first argument, which the
            pipeline cuts into micro-batches along dimension 0.
        *layers: names of submodules of ``module`` as in ``module.named_modules()``, in the order
            they run; a ``ModuleList`` or Sequential (``"transformer.h"``) stands for all its
            children, any other submodule is one layer. ``stages`` and ``balance`` cut these layers.

    Returns:
        A :class:`ModulePipeline` of your own layer objects; it adds no key to any ``state_dict``.

    Raises:
        PipeckptConfigError: ``module`` is not a module, no layer is named, a name is not a
            submodule, or a layer is named twice.
    """
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
