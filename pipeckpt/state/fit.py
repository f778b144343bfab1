"""A checkpoint of another model, told before it is loaded: its keys and shapes against the module's.

Why: torch's ``load_state_dict`` lists every differing key of a deep model in one traceback, and
says nothing of why. Here the first few differences are named under the module's own keys, with
the hyper-parameters in which the checkpoint's model differs from this one (Lightning saves
them), which is usually the fix.
"""

from typing import Any, List, Mapping, Optional

from torch import Tensor

from pipeckpt._errors import checkpoint_error

__all__ = ["check_fits"]

_SHOWN = 5  # differences named in the message


def _shape(value: Any) -> str:
    return str(tuple(value.shape)) if isinstance(value, Tensor) else type(value).__name__


def _differences(
    whole: Mapping[str, Any], held: Mapping[str, Any], found: Mapping[str, Any], *, strict: bool
) -> List[str]:
    """``whole``: the module's state dict (other ranks' entries on meta, shapes kept); ``held``:
    the part this process loads, every key of which must be ``found`` when ``strict``."""
    out: List[str] = []
    for key, value in whole.items():
        if key not in found:
            if strict and key in held:
                out.append(f"{key!r} is not in the checkpoint")
        elif isinstance(value, Tensor) and isinstance(found[key], Tensor) and value.shape != found[key].shape:
            out.append(f"{key!r} is {_shape(found[key])} in the checkpoint, {_shape(value)} in the model")
    if strict:
        out += [f"{key!r} is in the checkpoint, not in the model" for key in found if key not in whole]
    return out


def _hparams_differ(saved: Optional[Mapping[str, Any]], current: Optional[Mapping[str, Any]]) -> List[str]:
    if not saved or not current:
        return []
    return [
        f"{name}={saved[name]!r} (this model: {current[name]!r})"
        for name in saved
        if name in current and saved[name] != current[name]
    ]


def check_fits(
    module: Any,
    expected: Mapping[str, Any],
    checkpoint: Mapping[str, Any],
    *,
    strict: bool,
    source: Optional[str],
) -> None:
    """Raises ``PipeckptCheckpointError`` unless ``checkpoint["state_dict"]`` loads into ``module``:
    the same shapes for shared keys, and with ``strict`` no key the module lacks and every key of
    ``expected`` (the part of the module's state dict this process loads)."""
    problems = _differences(module.state_dict(), expected, checkpoint["state_dict"], strict=strict)
    if not problems:
        return
    model = type(module).__name__
    shown = "; ".join(problems[:_SHOWN]) + (
        f"; and {len(problems) - _SHOWN} more" if len(problems) > _SHOWN else ""
    )
    hparams = _hparams_differ(checkpoint.get("hyper_parameters"), getattr(module, "hparams", None))
    hint = (
        f"build the {model} the checkpoint was written with: {', '.join(hparams)}"
        if hparams
        else "resume from a checkpoint of this model (same layers and sizes), or start without ckpt_path"
    )
    where = f"checkpoint {source!r}" if source else "the checkpoint"
    raise checkpoint_error(
        f"{where} does not fit this {model}: {shown}",
        f"a checkpoint resumes only the model it was written from ({len(problems)} difference(s))",
        hint,
    )
