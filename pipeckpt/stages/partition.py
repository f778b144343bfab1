"""Cutting a user's ``nn.Sequential`` into stages and placing them on devices.

Every engine consumes the same :class:`StagePlan`, so balance, placement and
modes are decided once, validated once, and mean the same under the local
(torchgpipe) and the distributed (``torch.distributed.pipelining``) engine.
Profiled balance (time, memory) reuses torchgpipe's profilers.
"""

from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torchgpipe.balance import balance_by_size, balance_by_time

from pipeckpt._errors import config_error
from pipeckpt.checkpointing.modes import CheckpointMode
from pipeckpt.settings import PipeSettings
from pipeckpt.stages.gradients import gradients_set_aside

__all__ = ["StagePlan", "check_balance", "module_name", "plan", "split"]


def module_name(root: nn.Module, part: nn.Module) -> str:
    """``part``'s name in ``root`` as the user wrote it (``model.transformer.h``), for messages."""
    for name, m in root.named_modules():
        if m is part:
            return name or type(root).__name__
    return type(part).__name__


@dataclass(frozen=True)
class StagePlan:
    """Which layers form each stage, where each stage runs, and how it checkpoints."""

    balance: Tuple[int, ...]
    devices: Tuple[torch.device, ...]
    modes: Tuple[CheckpointMode, ...]

    @property
    def stages(self) -> int:
        return len(self.balance)

    @property
    def ranges(self) -> List[Tuple[int, int]]:
        """``(start, stop)`` layer indices of each stage in the user's Sequential."""
        out, start = [], 0
        for n in self.balance:
            out.append((start, start + n))
            start += n
        return out

    def describe(self) -> str:
        return ", ".join(
            f"stage {i}: layers {a}-{b - 1} on {d} ({m.name})"
            for i, ((a, b), d, m) in enumerate(zip(self.ranges, self.devices, self.modes))
        )


def split(sequential: nn.Sequential, balance: Sequence[int]) -> List[nn.Sequential]:
    """Partitions holding the user's own layer objects (no copies), so that the
    user's module, its ``state_dict`` keys and its optimizer see the same tensors."""
    layers = list(sequential)  # not children(): that drops a repeated layer
    parts, start = [], 0
    for n in balance:
        parts.append(nn.Sequential(*layers[start : start + n]))
        start += n
    return parts


def check_balance(balance: Sequence[int], layers: int) -> Tuple[int, ...]:
    """The one check of a balance that needs the model (its values were checked by the settings)."""
    balance = tuple(balance)
    if sum(balance) != layers:
        raise config_error(
            f"balance {list(balance)} (sum {sum(balance)})",
            f"must sum to the number of layers in the pipelined Sequential ({layers})",
            f"adjust the counts to sum to {layers}, or drop `balance` and set `stages`",
        )
    return balance


def _check_shared_parameters(
    sequential: nn.Sequential,
    balance: Sequence[int],
    devices: Sequence[torch.device],
    names: Optional[Sequence[str]] = None,
) -> None:
    """A parameter used by several stages (a tied input embedding and LM head) is one tensor
    when those stages share a device: each stage's backward adds its part to the one ``.grad``,
    as in the unpipelined model. Stages on different devices would each need a copy."""
    owner: Dict[int, Tuple[int, str]] = {}
    stage_of = [s for s, n in enumerate(balance) for _ in range(n)]
    for index, layer in enumerate(sequential):
        stage = stage_of[index]
        here = names[index] if names is not None else str(index)
        for name, p in layer.named_parameters(remove_duplicate=False):
            first, key = owner.setdefault(id(p), (stage, f"{here}.{name}"))
            if first != stage and devices[first] != devices[stage]:
                raise config_error(
                    f"parameter {key!r} (also {here}.{name}), shared by stage {first} on "
                    f"{devices[first]} and stage {stage} on {devices[stage]}",
                    "the local engine shares a parameter between stages on one device only",
                    "place the stages that use it on one device (`placement`), or choose a balance "
                    "that keeps its users in one stage",
                )


def min_max_partition(costs: Sequence[int], stages: int) -> Tuple[int, ...]:
    """Contiguous split of ``costs`` into ``stages`` non-empty blocks that
    minimises the largest block. Written here because torchgpipe's
    block-partition solver is an approximation that can pair the heaviest layer
    with a light one when it alone is the optimum; this exact dynamic program
    is O(layers^2 x stages), instant for any real layer count."""
    n = len(costs)
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: smallest max block for the first i layers in k blocks; cut[k][i]: last cut.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    sizes, i = [], n
    for k in range(stages, 0, -1):
        sizes.append(i - cut[k][i])
        i = cut[k][i]
    return tuple(reversed(sizes))


def _auto_balance(
    sequential: nn.Sequential,
    stages: int,
    balance_by: str,
    sample: Optional[Any],
    chunks: int,
    device: torch.device,
) -> Tuple[int, ...]:
    if balance_by == "params":
        # +1 so that parameter-free layers (activations, dropout) still count.
        costs = [1 + sum(p.numel() for p in layer.parameters()) for layer in sequential]
        return min_max_partition(costs, stages)
    if sample is None:
        raise config_error(
            f"balance_by={balance_by!r}",
            "profiling needs an example input",
            "set `example_input_array` on your LightningModule (a batch of pipeline input), "
            "or use balance_by='params' or an explicit balance",
        )
    if balance_by == "memory" and device.type != "cuda":
        raise config_error(
            f"balance_by='memory' on {device}",
            "torchgpipe profiles memory on CUDA devices only",
            "use balance_by='time' or 'params' on CPU",
        )
    with gradients_set_aside(sequential.parameters()):
        if balance_by == "time":
            return tuple(balance_by_time(stages, sequential, sample, device=device))
        return tuple(balance_by_size(stages, sequential, sample, chunks=chunks, device=device))


def _place(
    stages: int, devices: Sequence[torch.device], placement: Optional[Sequence[int]]
) -> Tuple[torch.device, ...]:
    if placement is not None:
        placement = list(placement)
        if len(placement) != stages or any(not 0 <= p < len(devices) for p in placement):
            raise config_error(
                f"placement {placement}",
                f"needs one device index per stage ({stages} stages), each in 0..{len(devices) - 1}",
                "list, for each stage, the index of the device it runs on",
            )
        return tuple(devices[p] for p in placement)
    if len(set(devices)) == 1:  # CPU, or a single GPU: every stage shares it
        return (devices[0],) * stages
    if stages > len(devices):
        raise config_error(
            f"{stages} stages on {len(devices)} devices",
            "each stage gets its own device unless a placement puts several on one",
            f"set stages <= {len(devices)}, more devices, or an explicit `placement` "
            f"such as {[i * len(devices) // stages for i in range(stages)]}",
        )
    return tuple(devices[:stages])


def plan(
    sequential: nn.Sequential,
    settings: Optional[PipeSettings] = None,
    devices: Sequence[torch.device] = (),
    *,
    sample: Optional[Any] = None,
    names: Optional[Sequence[str]] = None,
    **given: Any,
) -> StagePlan:
    """Validates every setting that needs the module and builds the plan.

    Settings that need no module were checked by :class:`~pipeckpt.settings.PipeSettings`.

    Args:
        sequential: the module's own layers, as
            :func:`pipeckpt.boundaries.contract.pipelined_sequential` returns them.
        settings: the strategy's settings (default: ``PipeSettings()``); the plan reads
            ``stages``, ``balance``, ``balance_by``, ``checkpoint``, ``placement`` and ``chunks``.
        devices: the devices the stages may run on.
        sample: an example input, for ``balance_by='time'`` or ``'memory'``.
        names: the user's name of each layer (``"layers.3"``), for messages.
        given: settings by name, over ``settings`` (``plan(seq, devices=cpu, balance=[2, 2])``).
    """
    s = replace(settings, **given) if settings is not None else PipeSettings(**given)
    if not devices:
        raise ValueError("plan() needs the devices the stages may run on")
    layers = len(sequential)
    balance: Optional[Tuple[int, ...]] = None
    if s.balance is not None:
        balance = check_balance(s.balance, layers)
    stages = len(balance) if balance is not None else s.stages or max(1, min(len(devices), layers))
    if stages > layers:
        raise config_error(
            f"stages={stages}",
            f"cannot exceed the number of layers ({layers})",
            f"set stages <= {layers}, or split your Sequential into more layers",
        )
    modes = s.stage_modes(stages)
    placed = _place(stages, devices, s.placement)
    if balance is None:
        balance = _auto_balance(sequential, stages, s.balance_by, sample, s.chunks, placed[0])
    _check_shared_parameters(sequential, balance, placed, names)
    return StagePlan(balance=tuple(balance), devices=placed, modes=modes)
