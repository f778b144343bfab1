"""A module built on the meta device, filled from a pretrained checkpoint where it is made real.

Why: ``from_pretrained`` in every process reads the whole checkpoint in each, and a model built on the
meta device (the way to build one larger than a process) had no way to get pretrained values.
:func:`pretrained` marks a module; when a process makes its own stages real
(:mod:`pipeckpt.stages.materialize`), every tensor it keeps is read from the checkpoint by its key alone
(plain reads of its byte ranges a few MiB at a time, :mod:`.ranged_read`, only the keys and slices
needed; a plain state-dict file is mapped, weights only), converted to the module's dtype. What the
checkpoint does not hold and the module does not save (rotary frequencies, masks) comes from the
module's own initialisation. Before any of that, marking the module checks it against the checkpoint on
keys and shapes alone (:mod:`.matching`, from the index and the safetensors headers: :mod:`.listing`),
so that a directory that cannot fill it is refused before any work.
"""

import weakref
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Set, Tuple, TypeVar, Union

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from pipeckpt._compat import local_extent, own_tensor, own_tensors, set_own_tensor
from pipeckpt._errors import config_error
from pipeckpt.weights.adapters import init_adapters
from pipeckpt.weights.hub import absent, local_directory
from pipeckpt.weights.listing import Listing, list_checkpoint
from pipeckpt.weights.matching import candidates, check
from pipeckpt.weights.ranged_read import SafetensorsFile

__all__ = [
    "pretrained",
    "Pretrained",
    "marked_in",
    "fill",
    "in_checkpoint",
    "reading_later",
    "read_later",
    "pending_reads",
]

M = TypeVar("M", bound=nn.Module)
MISSING = ("error", "init")
_marks: "weakref.WeakKeyDictionary[nn.Module, Pretrained]" = weakref.WeakKeyDictionary()
_later: Set[int] = set()  # ids of the meta tensors whose reads wait for their sharded layout
Slot = Tuple[nn.Module, str, bool]  # (owner, attribute, is a parameter)
_ABSENT_HINT = (
    "pass the directory save_pretrained wrote, or a Hub id after downloading it (huggingface-cli "
    "download org/name, or huggingface_hub.snapshot_download)"
)


def pretrained(module: M, path: Union[str, Path], *, missing: str = "error", ignore: Sequence[str] = ()) -> M:
    """``module``, to be filled from the checkpoint at ``path`` when the ``pipe`` strategy makes it
    real (build it on the meta device: in ``configure_model``, or under
    ``trainer.init_module(empty_init=True)``).

    Args:
        module: the model, e.g. ``AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))``.
        path: a Hugging Face directory (``model.safetensors.index.json`` and its shards, or
            ``model.safetensors``), a Hub id (``org/name``) whose snapshot is in huggingface_hub's
            local cache (never downloaded: :mod:`pipeckpt.weights.hub`), a ``.safetensors`` file, or
            a file ``torch.save`` wrote a state dict to. Keys are ``module``'s own (``state_dict()``);
            a Hugging Face checkpoint saved with or without the model's ``base_model_prefix`` fits
            either way, as in ``from_pretrained``.
            A directory's files are read only from inside it, or from its Hub repository folder for
            a snapshot of huggingface_hub's cache (:mod:`pipeckpt.weights.confinement`).
        missing: ``"error"``: a parameter or saved buffer the checkpoint lacks is an error naming
            it; ``"init"``: it is initialised as a build from scratch initialises it.
        ignore: regular expressions (``re.search``) of the checkpoint's keys to leave unread; any
            other key no tensor of ``module`` takes is an error (``from_pretrained``'s "unexpected
            keys"), as is a key of another shape. Checked here, on every process alike, from the
            index and the safetensors headers alone (:mod:`pipeckpt.weights.matching`).

    Returns:
        ``module`` itself. A resume (``trainer.fit(ckpt_path=...)``) takes precedence: its values
        replace the pretrained ones.
    """
    if missing not in MISSING:
        raise config_error(
            f"pretrained(missing={missing!r})", f"missing is one of {MISSING}", "use 'error' or 'init'"
        )
    if not any(t.is_meta for t in (*module.parameters(), *module.buffers())):
        raise config_error(
            f"pretrained({type(module).__name__}, {str(path)!r}) on a module whose tensors are real",
            "pretrained fills a module built on the meta device, where the pipe strategy makes it real",
            "build it in configure_model under the pipe strategy (or under "
            "trainer.init_module(empty_init=True)), or load it eagerly with from_pretrained",
        )
    found = local_directory(path)
    if not found.exists():
        raise config_error(f"pretrained(path={str(path)!r})", absent(), _ABSENT_HINT)
    source = Pretrained(found, missing)
    patterns = [ignore] if isinstance(ignore, str) else list(ignore)  # one pattern is not its letters
    check(module, source.listing(), source.path, missing=missing, ignore=patterns)
    _marks[module] = source
    return module


def marked_in(module: nn.Module) -> List[Tuple[nn.Module, "Pretrained"]]:
    """The modules in ``module`` (itself included) that :func:`pretrained` marked, with their source."""
    return [(m, _marks[m]) for m in module.modules() if m in _marks]


class Pretrained:
    """A pretrained checkpoint: which file holds each key, and reading a few keys of it."""

    def __init__(self, path: Path, missing: str) -> None:
        self.path, self.missing = path, missing
        self._listing: Optional[Listing] = None
        self.pending: List[Tuple[Slot, str]] = []  # made real, to read once sharded (read_later)

    def listing(self) -> Listing:
        """The checkpoint's keys, files and shapes (:mod:`pipeckpt.weights.listing`), read once."""
        if self._listing is None:
            self._listing = list_checkpoint(self.path)
        return self._listing

    def where(self) -> Dict[str, Path]:
        """Each key of the checkpoint -> the file holding it."""
        return self.listing().where

    def read(self, wanted: Dict[str, Tensor]) -> None:
        """Copies each key's tensor into its destination (converting the dtype), reading nothing else;
        into a DTensor, only this rank's slice of it (``safe_open(...).get_slice``)."""
        by_file: Dict[Path, List[str]] = {}
        for key in wanted:
            by_file.setdefault(self.where()[key], []).append(key)
        state = self.listing().state
        for file, keys in by_file.items():
            if state is not None:
                for key in keys:
                    _copy(wanted[key], state[key], key, file)
                continue
            with SafetensorsFile(file) as ranged:  # plain reads of a few MiB: nothing mapped
                for key in keys:
                    if ranged.readable(key):
                        _read_ranged(wanted[key], ranged, key, file)
                        continue
                    import safetensors

                    with safetensors.safe_open(str(file), framework="pt", device="cpu") as f:
                        split = isinstance(wanted[key], DTensor)
                        _copy(wanted[key], f.get_slice(key) if split else f.get_tensor(key), key, file)


def _read_ranged(dest: Tensor, source: SafetensorsFile, key: str, file: Path) -> None:
    """``key`` of ``source`` into ``dest`` (:mod:`.ranged_read`): whole, or the part of it that
    ``dest``'s shard holds when ``dest`` is a DTensor."""
    _check_shape(dest, source.shape(key), key, file)
    if isinstance(dest, DTensor):
        _, offset = local_extent(dest)
        source.read_into(dest.to_local(), key, offset)
    else:
        source.read_into(dest, key, (0,) * dest.dim())


def _check_shape(dest: Tensor, shape: Tuple[int, ...], key: str, file: Path) -> None:
    if tuple(dest.shape) != shape:
        raise config_error(
            f"{key} in {str(file)!r} has shape {shape}, the module's {tuple(dest.shape)}",
            "a pretrained checkpoint fills a module of the same configuration",
            "build the module from the checkpoint's own config (AutoConfig.from_pretrained(path))",
        )


def _copy(dest: Tensor, source: Any, key: str, file: Path) -> None:
    """``source`` (a tensor, or a safetensors slice, read only here) into ``dest``: whole, or the part
    of it that ``dest``'s shard holds when ``dest`` is a DTensor."""
    shape = tuple(source.get_shape() if hasattr(source, "get_shape") else source.shape)
    _check_shape(dest, shape, key, file)
    if isinstance(dest, DTensor):
        size, offset = local_extent(dest)
        dest = dest.to_local()
        source = source[tuple(slice(o, o + n) for o, n in zip(offset, size))]
    dest.copy_(source)


def fill(module: nn.Module, device: torch.device, keep: Any) -> Set[int]:
    """The meta tensors of every marked module in ``module`` that ``keep`` accepts made real on
    ``device`` from their checkpoints; returns the ids of the meta tensors left for the module's
    own initialisation (buffers it does not save; missing weights under ``missing='init'``)."""
    left: Set[int] = set()
    for model, source in marked_in(module):
        init_adapters(model, device, keep)  # PEFT's, before the rest: no checkpoint holds them
        names: Dict[int, List[str]] = {}
        slots: Dict[int, List[Tuple[nn.Module, str, bool]]] = {}
        for prefix, owner in model.named_modules(remove_duplicate=False):
            for slot, t, is_param in own_tensors(owner):
                if t.is_meta and (keep is None or keep(t)):
                    names.setdefault(id(t), []).append(f"{prefix}.{slot}" if prefix else slot)
                    slots.setdefault(id(t), []).append((owner, slot, is_param))
        saved = {id(t) for t in model.state_dict(keep_vars=True).values()}
        where = source.where()
        keys = {
            i: next((k for n in ns for k in candidates(model, n) if k in where), None)
            for i, ns in names.items()
        }
        missing = sorted(names[i][0] for i, k in keys.items() if k is None and i in saved)
        if missing and source.missing == "error":
            shown = ", ".join(missing[:4]) + (f", ... ({len(missing)} in all)" if len(missing) > 4 else "")
            raise config_error(
                f"{str(source.path)!r} lacks {shown} of {type(model).__name__}",
                "a module filled from a pretrained checkpoint finds every parameter and saved buffer "
                "there (buffers it does not save, such as rotary frequencies, come from its own code)",
                "build the module from the checkpoint's own config, or pretrained(..., missing='init') "
                "to initialise the missing ones as a build from scratch does",
            )
        wanted: Dict[str, Tensor] = {}
        for i, key in keys.items():
            if key is None:
                left.add(i)
                continue
            owner, slot, is_param = slots[i][0]
            meta = own_tensor(owner, slot, is_param)
            real = torch.empty_like(meta, device=device)
            if i in _later:
                source.pending.append((slots[i][0], key))
            else:
                wanted[key] = real
            value = nn.Parameter(real, meta.requires_grad) if is_param else real
            for owner, slot, is_param in slots[i]:  # a tied tensor stays one
                set_own_tensor(owner, slot, value, is_param)
        with torch.no_grad():
            source.read(wanted)
    return left


def in_checkpoint(module: nn.Module) -> Set[int]:
    """The ids of the meta tensors of the marked modules in ``module`` that their checkpoints hold
    (every process's, not only its own: a refusal is the same on every process)."""
    found: Set[int] = set()
    for model, source in marked_in(module):
        where = source.where()
        for name, t in (
            *model.named_parameters(remove_duplicate=False),
            *model.named_buffers(remove_duplicate=False),
        ):
            if t.is_meta and any(k in where for k in candidates(model, name)):
                found.add(id(t))
    return found


@contextmanager
def reading_later(ids: Set[int]) -> Iterator[None]:
    """Inside, :func:`fill` makes the meta tensors whose ids are in ``ids`` real but reads nothing
    into them: a rank that will hold only a shard of each (FSDP2, tensor parallelism) reads only
    that slice, once the shards are laid out (:func:`read_later`)."""
    _later.update(ids)
    try:
        yield
    finally:
        _later.difference_update(ids)


def pending_reads(module: nn.Module) -> Set[int]:
    """Ids of the tensors of ``module`` whose values :func:`read_later` will read (each replica the
    same checkpoint): nothing need give them values before, and touching their pages before they
    are sharded would make a process hold them whole for a moment."""
    inside = {id(m) for m in module.modules()}  # a marked model, or a stage of one
    return {
        id(own_tensor(owner, slot, is_param))
        for source in list(_marks.values())
        for (owner, slot, is_param), _ in source.pending
        if id(owner) in inside
    }


def read_later(module: nn.Module) -> None:
    """The reads :func:`reading_later` held back, into the tensors now in their slots: a DTensor gets
    its own slice of the checkpoint's tensor, any other tensor the whole."""
    for _, source in marked_in(module):
        wanted: Dict[str, Tensor] = {}
        for (owner, slot, is_param), key in source.pending:
            wanted[key] = own_tensor(owner, slot, is_param)
        source.pending = []
        with torch.no_grad():
            source.read(wanted)
