"""The plan command's per-rank table (``memory.fsdp``/``memory.tp``): one rank's memory per stage.

Why apart from :mod:`pipeckpt.plan`: the table of one device per stage profiles the model as it is;
this one builds it in the compute dtype, as one tensor-parallel rank's share where the model can be
built so (its ``tensor_parallel`` argument) or split by its own plan (a ``pipeline_of`` model's
``config.base_model_tp_plan``), and spreads each stage's state over its ranks
(:mod:`pipeckpt.memory.sharding`). A ``pipeline_of`` model's parameters outside its layers
(embedding, final norm, head) are counted on the stages that read them (:func:`with_outside`),
sharded and split over the vocabulary as the engine holds them.
"""

import inspect
from dataclasses import replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from hydra.utils import get_class
from omegaconf import DictConfig
from torch import nn

from pipeckpt._errors import config_error
from pipeckpt.boundaries.pipeline_of import ModulePipeline
from pipeckpt.engines import engine_class
from pipeckpt.engines.distributed.model_plan import model_plan
from pipeckpt.engines.distributed.tensor_parallel import check_sequence_parallel
from pipeckpt.engines.distributed.vocab_plan import own_outside_plan
from pipeckpt.memory.budget import first_microbatch
from pipeckpt.memory.outside_share import OutsideParam, sharded_share, units
from pipeckpt.memory.predict import Prediction, predict
from pipeckpt.memory.profile import ModelProfile, profile
from pipeckpt.memory.rank_peak import RankTable, per_rank, stage_orders
from pipeckpt.memory.repeated import repeat_layer, shortened
from pipeckpt.memory.sharding import Layout, rank_state
from pipeckpt.memory.tp_local import one_rank_profile
from pipeckpt.memory.vocab_share import split_over_vocabulary
from pipeckpt.plan_model import Built, built, three_layers
from pipeckpt.settings import PipeSettings
from pipeckpt.stages.partition import plan as make_plan

__all__ = ["takes_tensor_parallel", "rank_run", "with_outside"]


def takes_tensor_parallel(cfg: DictConfig) -> bool:
    """Whether the configured model is built as one rank's share by a ``tensor_parallel`` argument."""
    target = cfg.model.get("_target_")
    if not isinstance(target, str):
        return False
    try:
        return "tensor_parallel" in inspect.signature(get_class(target)).parameters
    except (ImportError, ValueError, TypeError):
        return False


def rank_run(
    cfg: DictConfig,
    settings: PipeSettings,
    layout: Layout,
    drawn: Any,
    *,
    fake: bool,
    optimizer: str,
    schedule: Optional[str],
) -> Tuple[RankTable, Optional[str]]:
    """One rank's table for ``layout``, and a line to print above it (None: nothing to say)."""
    by_argument = layout.tp > 1 and takes_tensor_parallel(cfg)
    extra = {"tensor_parallel": layout.tp} if by_argument else {}
    with built(cfg, drawn, fake=fake, extra=extra) as b:
        note, cut = None, None
        if layout.tp > 1 and not by_argument:
            layout, note = _own_plan(cfg, b.sequential, layout)
            cut = cfg  # its layers profiled cut to one rank by that plan
        if layout.sequence_parallel:  # refused as the engine refuses it, before any profile
            check_sequence_parallel(b.sequential, dict(layout.tp_plan))
        three = (three_layers(cfg, b.sequential) if fake else None, drawn, extra)
        prediction, ranges, outside = _predicted(
            b, settings, layout, fake=fake, optimizer=optimizer, schedule=schedule, three=three, cut=cut
        )
        return with_outside(prediction, b.sequential, ranges, layout, optimizer, outside), note


def _own_plan(cfg: DictConfig, sequential: nn.Sequential, layout: Layout) -> Tuple[Layout, str]:
    """``layout`` with the model's own tensor-parallel plan, for a model built whole."""
    if not isinstance(sequential, ModulePipeline):
        raise config_error(
            f"memory.tp={layout.tp} with model._target_={cfg.model._target_}",
            "the model is built as one tensor-parallel rank's share by its tensor_parallel argument, "
            "or split by its own plan (a pipeline_of model's config.base_model_tp_plan)",
            "use a model that takes it (model=llama3) or drop memory.tp",
        )
    layer, outside = model_plan(sequential, layout.tp), own_outside_plan(sequential)
    split = {**layer, **outside}
    vocab = f", and {', '.join(outside)} over the vocabulary" if outside else ""
    note = (
        f"memory.tp={layout.tp}: parameters split by the model's own plan ({len(layer)} entries per "
        f"layer{vocab}); activations profiled on one rank's cut of the layers"
        + (", and the head's logits split as it is" if "colwise" in outside.values() else "")
    )
    return replace(layout, tp_plan=tuple(split.items())), note


def _predicted(
    b: Built,
    settings: PipeSettings,
    layout: Layout,
    *,
    fake: bool,
    optimizer: str,
    schedule: Optional[str],
    three: Tuple[Optional[DictConfig], Any, Dict[str, Any]] = (None, None, {}),
    cut: Optional[DictConfig] = None,
) -> Tuple[Prediction, List[Tuple[int, int]], Optional[Sequence[OutsideParam]]]:
    """The walk's prediction for the plan's stages, a run of identical blocks profiled once on fake
    tensors (a Sequential's cut to three, a ``pipeline_of`` model's built again with three where
    ``three`` holds those configs, :func:`~pipeckpt.plan_model.three_layers`, the batch and the
    build's arguments), the logits of a head ``layout`` splits over the vocabulary counted as one
    rank holds them (memory/vocab_share.py); each stage's range of layers; a ``pipeline_of`` model's
    parameters outside its layers and who reads them. ``cut``: the model's config where ``layout``'s
    plan is the model's own: its layers are profiled on a build of their own cut to one rank by it
    (:mod:`pipeckpt.memory.tp_local`), as the layout search profiles them: their activations one
    rank's, their parameters' figures whole."""
    sequential = b.sequential
    stage_plan = make_plan(sequential, settings, [torch.device("cpu")], sample=b.inputs)
    rooted = isinstance(sequential, ModulePipeline)  # its own forward runs every layer
    short, index, count = shortened(sequential) if fake and not rooted else (sequential, 0, 1)
    chunks = settings.chunks
    plan = dict(layout.tp_plan) if cut is not None else {}
    sequence = layout.sequence_parallel
    if three[0] is not None:  # a pipeline_of model built again with three of its layers
        with built(three[0], three[1], fake=True, extra=three[2]) as short_b:
            b, short, index, count = short_b, short_b.sequential, 1, len(sequential) - 2
            fitted = one_rank_profile(
                short, plan, layout.tp, lambda: _profiled(short_b, short, chunks, fake), sequence=sequence
            )
    elif cut is not None:  # the model's own build stays whole: its parameters are counted from it
        with built(cut, three[1], fake=True) as cut_b:
            fitted = one_rank_profile(
                cut_b.sequential,
                plan,
                layout.tp,
                lambda: _profiled(cut_b, cut_b.sequential, chunks, True),
                sequence=sequence,
            )
    else:
        fitted = _profiled(b, short, chunks, fake)
    fitted = repeat_layer(fitted, index, count) if count > 1 else fitted
    fitted = split_over_vocabulary(fitted, layout.tp, layout.tp_plan)
    schedule = schedule or engine_class(settings.engine).memory_schedule(settings)
    prediction = predict(fitted, stage_plan, chunks=chunks, optimizer=optimizer, schedule=schedule)
    return prediction, list(stage_plan.ranges), fitted.outside_params


def _profiled(b: Built, layers: nn.Sequential, chunks: int, fake: bool) -> ModelProfile:
    """One micro-batch of ``b``'s batch through ``layers`` (``b.sequential`` or its cut)."""
    return profile(
        layers,
        first_microbatch(b.inputs, chunks),
        loss_fn=b.loss_fn,
        target=first_microbatch(b.targets, chunks) if b.targets is not None else None,
        fake=fake,
    )


def with_outside(
    prediction: Prediction,
    sequential: nn.Sequential,
    ranges: Sequence[Tuple[int, int]],
    layout: Layout,
    optimizer: str,
    outside: Optional[Sequence[OutsideParam]] = None,
) -> RankTable:
    """:func:`~pipeckpt.memory.sharding.rank_table` with a ``pipeline_of`` model's parameters
    outside its layers counted where the walk counts them: under the distributed engine on the stages
    that read them (``outside``), sharded where a stage alone holds one (the engine shards those with
    the layers), else whole; under the local engine all on the last stage, whole. Whole: master dtype,
    their gradients and optimizer state."""
    layers = list(sequential)
    root = getattr(sequential, "root", None)
    unsharded = Layout(precision=layout.precision)
    if outside is None or root is None or prediction.schedule == "local":
        return _on_the_last_stage(prediction, sequential, ranges, layout, optimizer)
    ranks = []
    orders = stage_orders(prediction.schedule, len(prediction.stages), prediction.chunks)
    shares = sharded_share(outside, ranges)
    for s, (a, b), (alone, whole), order in zip(prediction.stages, ranges, shares, orders):
        held = units(root, alone, layout.tp_plan, layout.tp)
        state = rank_state(layers[a:b], layout, optimizer, held)
        if whole:
            kept = rank_state(units(root, whole), unsharded, optimizer)
            state = replace(
                state,
                params=state.params + kept.params,
                grads=state.grads + kept.grads,
                optimizer=state.optimizer + kept.optimizer,
                grads_backward=None if state.grads_backward is None else state.grads_backward + kept.grads,
            )
        ranks.append(per_rank(s, state, order))
    return RankTable(
        ranks=tuple(ranks), layout=layout, schedule=prediction.schedule, chunks=prediction.chunks
    )


def _on_the_last_stage(
    prediction: Prediction,
    sequential: nn.Sequential,
    ranges: Sequence[Tuple[int, int]],
    layout: Layout,
    optimizer: str,
) -> RankTable:
    """:func:`with_outside` where one process holds every parameter outside the layers (the local
    engine: the walk counts them on the last stage) or there are none (a Sequential)."""
    layers = list(sequential)
    outside = _outside(sequential)
    whole = rank_state([outside], Layout(precision=layout.precision), optimizer) if outside else None
    as_built = _bytes(outside) if outside else 0
    ranks = []
    orders = stage_orders(prediction.schedule, len(prediction.stages), prediction.chunks)
    for s, (a, b), order in zip(prediction.stages, ranges, orders):
        state = rank_state(layers[a:b], layout, optimizer)
        beyond = s.params - sum(_bytes(layer) for layer in layers[a:b])
        if whole is not None and beyond > 0:
            share = beyond / as_built  # 1 on the stage that holds them all
            grads = round(share * whole.grads)
            state = replace(
                state,
                params=state.params + round(share * whole.params),
                grads=state.grads + grads,
                optimizer=state.optimizer + round(share * whole.optimizer),
                grads_backward=None if state.grads_backward is None else state.grads_backward + grads,
            )
        ranks.append(per_rank(s, state, order))
    return RankTable(
        ranks=tuple(ranks), layout=layout, schedule=prediction.schedule, chunks=prediction.chunks
    )


def _bytes(module: nn.Module) -> int:
    """Bytes of ``module``'s parameters as built (each tensor once), as the walk counts them."""
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in module.parameters()}.values())


def _outside(sequential: nn.Sequential) -> Optional[nn.Module]:
    """A ``pipeline_of`` model's parameters outside its layers, as one module; None for a Sequential."""
    if not isinstance(sequential, ModulePipeline):
        return None
    inside = {id(p) for p in sequential.parameters()}
    own = [p for p in sequential.root.parameters() if id(p) not in inside]
    return nn.ParameterList(own) if own else None
