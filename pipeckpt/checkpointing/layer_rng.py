"""Per-layer random streams: dropout masks that do not depend on the pipeline's layout.

Layer ``k`` runs micro-batch ``m`` of training call ``c`` with its device's generator seeded from
``(seed, c, m, k)``, and the caller's state is put back after it, so the masks are the same under every
stage count, engine, schedule and mode, and a resume continues them (``seed`` and ``c`` travel in the
checkpoint). A ``pipeline_of`` model's own code after its ``n``-th layer call draws from ``(seed, c, m, n)``
too (:class:`AfterLayers`). Why not the current generator: its draws follow the schedule's order, which
changes with the layout. Why not ``torch.random.fork_rng`` per layer: it saves every device's state,
several times the cost. Cost: ``benchmarks/RESULTS_layer_rng.md``; the design and the alternatives
weighed: docs/DESIGN.md, checkpointing/layer_rng.
"""

import contextlib
import functools
import threading
from typing import Any, Callable, ContextManager, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from pipeckpt._errors import config_error

__all__ = ["LAYER_RNG", "NO_STREAMS", "AfterLayers", "LayerStreams", "check_layer_rng"]

LAYER_RNG = ("auto", "all", "off")


def check_layer_rng(layer_rng: Any) -> None:
    if layer_rng not in LAYER_RNG:
        raise config_error(
            f"layer_rng={layer_rng!r}",
            f"must be one of {LAYER_RNG}",
            "use 'auto' (layers that draw random numbers get streams of their own), 'all' (every layer), "
            "or 'off' (the caller's generator, in schedule order)",
        )


_MASK = (1 << 64) - 1
_AFTER = 0xAF7E2  # salts the model's code after a layer call apart from the layers' own streams


def _mix(x: int) -> int:
    """SplitMix64's output function: 64 well-mixed bits from any 64. Hand-written because it is three
    lines, and library hashes (numpy's SeedSequence) cost microseconds per call."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


class _Current(threading.local):
    """The micro-batch key of the stage task running on this thread (None: no task)."""

    key: Optional[int] = None


class _Microbatch:
    """Makes micro-batch ``key`` current on this thread for the ``with`` block."""

    __slots__ = ("current", "key", "previous")

    def __init__(self, current: _Current, key: int) -> None:
        self.current, self.key = current, key
        self.previous: Optional[int] = None

    def __enter__(self) -> None:
        self.previous = self.current.key
        self.current.key = self.key

    def __exit__(self, *_: Any) -> None:
        self.current.key = self.previous


def _generators(devices: Sequence[torch.device]) -> List[torch.Generator]:
    """The default generators of the CPU and of each GPU in ``devices``, once each."""
    cuda = [d for d in devices if d.type == "cuda"]
    gpus = sorted({torch.cuda.current_device() if d.index is None else d.index for d in cuda})
    return [torch.default_generator, *(torch.cuda.default_generators[i] for i in gpus)]


class AfterLayers:
    """One micro-batch's pass of a ``pipeline_of`` model's own ``forward``: after its ``n``-th layer call
    returns (:meth:`layer_returned`), the model's code draws from generators seeded from
    ``(seed, c, m, n)``, the same on every device; the pass's end puts back the caller's states of
    them as the first layer call found them. So those draws do not depend on which process runs the
    pass or in what order the micro-batches run, and the caller's generator sees only the draws
    made before the first layer, in micro-batch order under both engines."""

    __slots__ = ("calls", "generators", "key", "saved")

    def __init__(self, key: int, generators: Sequence[torch.Generator]) -> None:
        self.key, self.generators = key, list(generators)
        self.calls = 0
        self.saved: Optional[List[torch.Tensor]] = None

    def layer_returned(self) -> None:
        if self.saved is None:
            self.saved = [g.get_state() for g in self.generators]
        self.calls += 1
        seed = _mix(self.key ^ _mix(self.calls ^ _AFTER))
        for generator in self.generators:
            generator.manual_seed(seed)

    def __enter__(self) -> "AfterLayers":
        return self

    def __exit__(self, *_: Any) -> None:
        if self.saved is not None:
            for generator, state in zip(self.generators, self.saved):
                generator.set_state(state)
            self.saved = None


class _Unseeded(AfterLayers):
    """The model's code draws from the caller's generators throughout (``off``, or outside training)."""

    def __init__(self) -> None:
        super().__init__(0, [])

    def layer_returned(self) -> None:
        pass


NO_STREAMS: AfterLayers = _Unseeded()
_NO_KEY = contextlib.nullcontext()


def _unwrapped(layer: nn.Module, wrapped: Callable[..., Any], own: Optional[Any]) -> None:
    """``layer`` gets back the forward it had before ``wrapped``, unless another wrapper has taken
    the place of ours since (it keeps calling ours, which then passes straight through)."""
    if layer.__dict__.get("forward") is wrapped:
        if own is None:
            del layer.__dict__["forward"]
        else:
            layer.forward = own


class _Draws:
    """Whether one layer draws random numbers: True (seeded), False (run as it is), None (not known
    yet: ``auto`` before the layer's first training call)."""

    __slots__ = ("known",)

    def __init__(self, known: Optional[bool]) -> None:
        self.known = known


class LayerStreams:
    """One engine's per-layer streams: the seed, the count of training calls, the seeded layers.

    The engine calls :meth:`start` when it builds, :meth:`attach` on the pipelined layers,
    :meth:`next_call` at each training call of the pipeline, and :meth:`detach` at teardown;
    a :class:`~pipeckpt.stages.stage.Stage` runs each micro-batch inside :meth:`microbatch`.
    """

    def __init__(self, scope: str = "auto") -> None:
        check_layer_rng(scope)
        self.scope = scope
        self.seed: Optional[int] = None
        self.calls = 0  # training calls of the pipeline so far
        self._call_key = 0
        self._current = _Current()
        self._attached: List[Tuple[nn.Module, Callable[..., Any], Optional[Any], _Draws]] = []
        self._seeding = 0  # attached layers that draw or are not known yet; none: no key is needed

    @property
    def enabled(self) -> bool:
        return self.scope != "off"

    @property
    def seeding(self) -> bool:
        """Whether a micro-batch needs a key: some attached layer draws or is not known yet."""
        return self._seeding > 0

    def start(self, seed: Optional[int] = None) -> None:
        """Fixes the seed: ``seed``, else one restored from a checkpoint, else ``torch.initial_seed()``."""
        if seed is not None:
            self.seed = int(seed)
        elif self.seed is None:
            self.seed = torch.initial_seed()
        self._call_key = _mix(_mix(self.seed & _MASK) ^ self.calls)

    def next_call(self) -> None:
        """A training call of the pipeline begins: its micro-batches get new keys."""
        self.calls += 1
        if self.seed is None:
            self.start()
        self._call_key = _mix(_mix(self.seed & _MASK) ^ self.calls)  # type: ignore[operator]

    def microbatch(self, index: int) -> ContextManager[None]:
        """The context in which a stage runs micro-batch ``index`` of the current call (nothing to
        enter once every layer is known not to draw: no layer reads the key)."""
        if not self._seeding:
            return _NO_KEY
        return _Microbatch(self._current, _mix(self._call_key ^ index))

    def after_layers(self, index: int, devices: Sequence[torch.device]) -> AfterLayers:
        """The streams of a ``pipeline_of`` model's own code after each layer call during micro-batch
        ``index``'s pass of its ``forward`` (seeding ``devices``' generators and the CPU's)."""
        return AfterLayers(_mix(self._call_key ^ index), _generators(devices))

    def current(self) -> Optional[int]:
        """This thread's micro-batch key (for a recompute to restore it)."""
        return self._current.key

    def set_current(self, key: Optional[int]) -> None:
        self._current.key = key

    # -- layers -----------------------------------------------------------------------

    def attach(self, layers: Sequence[nn.Module], devices: Sequence[torch.device]) -> None:
        """Seeds ``layers[k]`` (global index ``k``, on ``devices[k]``) per micro-batch, per :attr:`scope`.

        ``all`` seeds every training call of every layer. ``auto`` seeds a layer's first training
        call and watches its device's generator: a layer that drew (a dropout module, or a
        functional draw in its own code such as ``F.scaled_dot_product_attention(dropout_p=...)``)
        stays seeded; one that did not runs as it is from then on, which draws the same (nothing).
        The layer's ``forward`` is wrapped by an instance attribute (what ``pipeline_of``'s routing
        takes as the layer's own forward, so it must be attached first); a forward hook would not
        run in a recompute, which calls the forward directly."""
        if not self.enabled:
            return
        for index, (layer, device) in enumerate(zip(layers, devices)):
            own = layer.__dict__.get("forward")
            draws = _Draws(True if self.scope == "all" else None)
            wrapped = self._seeded(layer, index, device, layer.forward, draws, own)
            layer.forward = wrapped
            self._attached.append((layer, wrapped, own, draws))
            self._seeding += 1

    def detach(self) -> None:
        """Every wrapped layer gets back the forward it had (unless another wrapper replaced ours)."""
        for layer, wrapped, own, _ in reversed(self._attached):
            _unwrapped(layer, wrapped, own)
        self._attached = []
        self._seeding = 0

    def release(self, layers: Sequence[nn.Module]) -> None:
        """``layers`` run in no stage of this process (the other ranks' layers of a distributed
        pipeline): they get their own forward back and no longer count as not known, so that once
        this process's own layers are known not to draw, its micro-batches enter no key."""
        gone = {id(layer) for layer in layers}
        kept = []
        for entry in self._attached:
            layer, wrapped, own, draws = entry
            if id(layer) not in gone:
                kept.append(entry)
                continue
            if draws.known is not False:
                self._seeding -= 1
            _unwrapped(layer, wrapped, own)
        self._attached = kept

    @property
    def seeded_layers(self) -> List[nn.Module]:
        """The layers in streams: every layer, unless ``off``."""
        return [layer for layer, _, _, _ in self._attached]

    @property
    def drawing_layers(self) -> List[nn.Module]:
        """The layers seeded at each training call: every one under ``all``; under ``auto`` those
        whose first training call drew random numbers (none before any training call)."""
        return [layer for layer, _, _, draws in self._attached if draws.known is True]

    def _seeded(
        self,
        layer: nn.Module,
        index: int,
        device: torch.device,
        forward: Callable[..., Any],
        draws: "_Draws",
        own: Optional[Any],
    ) -> Callable[..., Any]:
        salt = _mix(index ^ 0x5EED)
        current = self._current
        cpu = device.type != "cuda"

        @functools.wraps(forward)  # the layer's own signature, which side inputs are routed by
        def in_own_stream(*args: Any, **kwargs: Any) -> Any:
            key = current.key
            if key is None or not layer.training or draws.known is False:
                return forward(*args, **kwargs)
            if cpu:
                generator = torch.default_generator
            else:
                generator = torch.cuda.default_generators[
                    device.index if device.index is not None else torch.cuda.current_device()
                ]
            saved = generator.get_state()
            generator.manual_seed(_mix(key ^ salt))
            seeded = generator.get_state() if draws.known is None else None
            try:
                return forward(*args, **kwargs)
            finally:
                if seeded is not None:  # auto, first training call: did the layer draw?
                    draws.known = not torch.equal(generator.get_state(), seeded)
                    if not draws.known:
                        self._runs_as_it_is(layer, in_own_stream, own)
                generator.set_state(saved)

        return in_own_stream

    def _runs_as_it_is(self, layer: nn.Module, wrapped: Callable[..., Any], own: Optional[Any]) -> None:
        """A layer found not to draw gets its own forward back, unless another wrapper took the
        place of ours (``pipeline_of``'s routing keeps calling ours, which passes straight through):
        a dispatch-bound stage pays for every Python call per layer and micro-batch."""
        self._seeding -= 1
        _unwrapped(layer, wrapped, own)

    # -- checkpoints ------------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        return {"seed": self.seed, "calls": self.calls}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.calls = int(state["calls"])
        self.start(state["seed"])
