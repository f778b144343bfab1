"""What the cost model needs of a model: each layer's FLOPs and parameters, what crosses a stage
boundary, and the parts outside the layers.

Why two sources: a model too large to profile, or described only by its Hugging Face config, is
counted analytically (the published formulas, so that a FLOP here is a FLOP in the papers the
estimate is checked against); any other model is read from the project's per-layer profile
(:mod:`pipeckpt.memory.profile`), whose times come from FLOP counts on fake tensors or from a
measurement on this machine.
"""

import inspect
from dataclasses import dataclass
from typing import Any, Optional, Tuple

from pipeckpt._errors import config_error
from pipeckpt.layout.split_backward import HALVES, SplitBackward, from_flops
from pipeckpt.memory.profile import ModelProfile
from pipeckpt.memory.profile import profile as profile_fn

__all__ = [
    "ADAMW_ELEMENTS_PER_PARAM",
    "FsdpHostCosts",
    "ModelCosts",
    "TensorParallelCosts",
    "model_costs_from_config",
    "model_costs_from_profile",
    "dtype_bytes",
]

#: Elements AdamW's step reads and writes per parameter (torch.optim.AdamW: reads the parameter, its
#: gradient and two moments, writes the parameter and the moments); the step is memory-bound.
ADAMW_ELEMENTS_PER_PARAM = 7

#: Bytes of the compute dtype under each Lightning precision name.
_COMPUTE_BYTES = {"32-true": 4, "32": 4, "bf16-mixed": 2, "bf16-true": 2, "16-mixed": 2, "16-true": 2}


def dtype_bytes(precision: str) -> int:
    """Bytes per element of the compute dtype of ``precision`` (a Lightning name)."""
    if precision not in _COMPUTE_BYTES:
        raise config_error(f"precision {precision!r}", f"one of {sorted(_COMPUTE_BYTES)}", "use one of those")
    return _COMPUTE_BYTES[precision]


@dataclass(frozen=True)
class TensorParallelCosts:
    """A split layer's time at ``tp`` as the cost model prices it on ``local``: ``whole x (unsplit +
    (1 - unsplit) / tp) + host`` per micro-batch, and the same for the code outside the layers.

    Args:
        unsplit: the share of a layer's time that tensor parallelism does not divide (0: all of it
            divides, as on the presets).
        host_s: seconds a split adds to one layer's forward and to its backward, per micro-batch.
        head_unsplit, head_host_s: the same for the code outside the layers (the last stage's).
    """

    unsplit: float = 0.0
    host_s: Tuple[float, float] = (0.0, 0.0)
    head_unsplit: float = 0.0
    head_host_s: Tuple[float, float] = (0.0, 0.0)


@dataclass(frozen=True)
class FsdpHostCosts:
    """What FSDP2 costs the host a step beyond its collectives, per layer it shards: measured on
    ``local`` by :mod:`pipeckpt.plan_fsdp_host`; nothing elsewhere (on an accelerator the dispatch
    overlaps the kernels it launches).

    Args:
        step_s: seconds a step and sharded layer: DTensor's dispatch in the optimizer's step and in
            FSDP2's hooks, and its copies into and out of its flat buffers. Not per micro-batch: on
            this project's machine the difference between one micro-batch and two was within the
            measurement's noise (-10 to +67 ms a step on the app's GPT over five measurements).
    """

    step_s: float = 0.0


@dataclass(frozen=True)
class ModelCosts:
    """A model as the cost model counts it. FLOPs are forward FLOPs per token (2 per multiply-add);
    backward costs ``backward_factor`` forwards (2: input and weight gradients of every matmul).

    Args:
        name: what it is.
        seq_len: the sequence length ``layer_flops`` was counted at.
        hidden: hidden size (what a tensor-parallel all-reduce carries per token).
        heads: attention heads.
        vocab: vocabulary size.
        layer_flops: each layer's forward FLOPs per token at ``seq_len``.
        layer_attention_flops: of those, the FLOPs per token per token of context (the attention
            scores and their product with the values), which scale with the sequence; 0 where unknown.
        layer_params: each layer's parameters.
        embedding_params: parameters before the layers (held by the first stage).
        head_params: parameters after them (final norm and head, held by the last stage).
        head_flops: forward FLOPs per token after the layers (the head's matmul).
        boundary_bytes_per_token: bytes a stage boundary carries per token, in the compute dtype.
        selective_share: share of a layer's forward FLOPs that ``selective`` recomputes (pipeckpt's
            policy keeps every matmul and attention output: about 0).
        backward_factor: a layer's backward over its forward.
        tensor_parallel: what a tensor-parallel split costs beyond ``1 / tp`` of the time: measured
            on ``local`` by :mod:`pipeckpt.plan_tp_host`; nothing elsewhere (on an accelerator the
            dispatch overlaps the kernels it launches, and the parts the plan leaves whole are small).
        split_backward: a zero-bubble schedule's input and weight passes against the backward
            (:mod:`pipeckpt.layout.split_backward`: counted from FLOPs, or measured on ``local``).
        fsdp_host: what FSDP2 costs the host per sharded layer (:class:`FsdpHostCosts`).
        module_pipeline: a ``pipeline_of`` model, whose replicas average their gradients after the
            step, where a Sequential's reduce under DDP (:mod:`pipeckpt.layout.replicas`).
    """

    name: str
    seq_len: int
    hidden: int
    heads: int
    vocab: int
    layer_flops: Tuple[float, ...]
    layer_attention_flops: Tuple[float, ...]
    layer_params: Tuple[int, ...]
    embedding_params: int
    head_params: int
    head_flops: float
    boundary_bytes_per_token: float
    selective_share: float = 0.0
    backward_factor: float = 2.0
    tensor_parallel: TensorParallelCosts = TensorParallelCosts()
    split_backward: SplitBackward = HALVES
    fsdp_host: FsdpHostCosts = FsdpHostCosts()
    module_pipeline: bool = False

    @property
    def layers(self) -> int:
        return len(self.layer_flops)

    @property
    def params(self) -> int:
        return sum(self.layer_params) + self.embedding_params + self.head_params

    def flops_at(self, seq_len: int) -> Tuple[float, ...]:
        """Each layer's forward FLOPs per token at ``seq_len`` (the attention part rescaled)."""
        if seq_len == self.seq_len:
            return self.layer_flops
        if not any(self.layer_attention_flops) and any(self.layer_flops):
            raise config_error(
                f"seq_len={seq_len} for {self.name} counted at {self.seq_len}",
                "a profile's FLOPs hold at the sequence length it was taken at",
                f"profile at seq_len={seq_len}, or estimate at {self.seq_len}",
            )
        d = seq_len - self.seq_len
        return tuple(f + a * d for f, a in zip(self.layer_flops, self.layer_attention_flops))

    def model_flops_per_token(self, seq_len: int) -> float:
        """Forward + backward FLOPs of one token without recompute (what MFU divides by)."""
        return (1 + self.backward_factor) * (sum(self.flops_at(seq_len)) + self.head_flops)


def _get(config: Any, *names: str, default: Any = None) -> Any:
    for n in names:
        v = config.get(n) if isinstance(config, dict) else getattr(config, n, None)
        if v is not None:
            return v
    return default


def model_costs_from_config(config: Any, *, seq_len: int, precision: str = "bf16-mixed") -> ModelCosts:
    """A decoder's costs from its Hugging Face config (a ``PretrainedConfig`` or a dict with its
    keys): Llama-shaped (grouped-query attention, a gated MLP of ``intermediate_size``, RMSNorm) or
    GPT-shaped (a two-matrix MLP, ``n_inner`` or 4 x hidden, LayerNorm; learnt positions where the
    config names ``n_positions``, as GPT-2's does, none for rotary ones such as GPT-NeoX).

    FLOPs per token and layer, forward (Narayanan et al., SC'21, section 5.1: 2 FLOPs per
    multiply-add, attention over the whole sequence as their Eq. 3 and torchtitan's MFU count it):
    ``2 h (2 h + 2 kv) + 2 m h f + 4 s h`` with ``kv`` the key/value width, ``m`` the MLP's matrices
    (3 gated, 2 not) and ``f`` its width; the head ``2 h V``. For GPT (``kv = h``, ``m = 2``,
    ``f = 4h``) that is their ``24 h^2 + 4 s h``.

    Args:
        config: the model's config.
        seq_len: tokens per sample.
        precision: Lightning's precision name (the boundary's dtype).
    """
    h = int(_get(config, "hidden_size", "n_embd", "d_model", default=0))
    layers = int(_get(config, "num_hidden_layers", "n_layer", "num_layers", default=0))
    heads = int(_get(config, "num_attention_heads", "n_head", default=0))
    vocab = int(_get(config, "vocab_size", default=0))
    if min(h, layers, heads, vocab) <= 0:
        raise config_error(
            f"config {type(config).__name__}",
            "a decoder config names hidden_size, num_hidden_layers, num_attention_heads and vocab_size",
            "pass a Hugging Face decoder config, or build the costs from a profile",
        )
    head_dim = int(_get(config, "head_dim", default=h // heads) or h // heads)
    kv = int(_get(config, "num_key_value_heads", default=heads)) * head_dim
    gated = _get(config, "intermediate_size") is not None and str(
        _get(config, "hidden_act", "activation_function", default="silu")
    ) in ("silu", "swiglu", "gelu_pytorch_tanh", "geglu")
    ffn = int(_get(config, "intermediate_size", "n_inner", default=None) or 4 * h)
    m = 3 if gated else 2
    q = heads * head_dim
    attention = 2 * h * (2 * q + 2 * kv)  # q and o (h x q each), k and v (h x kv each)
    dense = attention + 2 * m * h * ffn
    bias = bool(_get(config, "attention_bias", default=not gated))
    norms = 2 * h if gated else 4 * h  # RMSNorm weights, or LayerNorm weights and biases
    params = h * (2 * q + 2 * kv) + m * h * ffn + norms
    if bias:
        params += 2 * q + 2 * kv + (ffn + h if not gated else 0)
    # learnt positions: GPT-2's n_positions; a rotary model (Llama, GPT-NeoX) has none
    positions = int(_get(config, "n_positions", default=0)) * h
    return ModelCosts(
        name=str(_get(config, "model_type", default="decoder")),
        seq_len=seq_len,
        hidden=h,
        heads=heads,
        vocab=vocab,
        layer_flops=(float(dense + 4 * seq_len * q),) * layers,
        layer_attention_flops=(float(4 * q),) * layers,
        layer_params=(params,) * layers,
        embedding_params=vocab * h + positions,
        # the final norm and the head (a tied head is the embedding, held again by the last stage)
        head_params=(h if gated else 2 * h) + vocab * h,
        head_flops=float(2 * h * vocab),
        boundary_bytes_per_token=float(h * dtype_bytes(precision)),
        split_backward=from_flops(dense, 4 * seq_len * q),
    )


def model_costs_from_profile(
    profile: ModelProfile,
    *,
    flops_per_s: Optional[float] = None,
    seq_len: int = 1,
    microbatch: Optional[int] = None,
    hidden: int = 0,
    heads: int = 0,
    vocab: int = 0,
    param_bytes: int = 4,
    name: str = "profiled",
    attention_flops: Optional[Tuple[float, ...]] = None,
) -> ModelCosts:
    """Any model's costs from the project's per-layer profile of one micro-batch: a layer's forward
    FLOPs are its forward seconds times the rate they were taken at (``flops_per_s``: the profile's
    own under ``fake=True``, else the measuring device's achieved rate, e.g. ``cluster("local")``'s),
    per token of the profiled micro-batch; the backward factor is the measured backward over forward;
    ``selective`` recomputes the share of each forward its policy does not keep (``1 - sac_s /
    forward_s``); the boundary is the last layer's output storages per token.

    Args:
        profile: :func:`pipeckpt.memory.profile.profile`'s result.
        flops_per_s: the rate its times convert at (None: a fake profile's, the default rate of
            :func:`~pipeckpt.memory.profile.profile`; a measured profile needs the measuring device's).
        seq_len: tokens per sample of the profiled micro-batch (1: a sample is a token).
        microbatch: samples in the profiled micro-batch (None: the profile's own count).
        hidden, heads, vocab: the model's, where it has them (0: not a transformer; tensor
            parallelism's all-reduces are then counted from the boundary).
        param_bytes: bytes per parameter in the profiled model (4: float32).
        name: what it is.
        attention_flops: per layer, the forward FLOPs per token per token of context, to rescale to
            another sequence length (None: zeros, the profile holds at ``seq_len`` only).
    """
    if flops_per_s is None:
        if not profile.fake:
            raise config_error(
                "model_costs_from_profile of a measured profile without flops_per_s",
                "measured seconds become FLOPs at the rate of the device that measured them",
                "pass flops_per_s=cluster('local').device.flops(precision)",
            )
        flops_per_s = float(inspect.signature(profile_fn).parameters["flops_per_s"].default)
    tokens = max(1, (microbatch or profile.microbatch_size) * seq_len)
    layers = profile.layers
    forward = [x.forward_s for x in layers]
    total_f = sum(forward)
    kept = sum(x.sac_s for x in layers)
    last = layers[-1] if layers else None
    boundary = profile.bytes_of(set(last.outputs)) if last is not None else 0
    loss = profile.loss
    return ModelCosts(
        name=name,
        seq_len=seq_len,
        hidden=hidden,
        heads=heads,
        vocab=vocab,
        layer_flops=tuple(f * flops_per_s / tokens for f in forward),
        layer_attention_flops=attention_flops or (0.0,) * len(layers),
        layer_params=tuple(x.param_bytes // param_bytes for x in layers),
        embedding_params=0,
        head_params=(loss.param_bytes // param_bytes) if loss is not None else 0,
        head_flops=(loss.forward_s * flops_per_s / tokens) if loss is not None else 0.0,
        boundary_bytes_per_token=boundary / tokens,
        selective_share=max(0.0, 1 - kept / total_f) if total_f > 0 else 0.0,
        backward_factor=(sum(x.backward_s for x in layers) / total_f) if total_f > 0 else 2.0,
    )
