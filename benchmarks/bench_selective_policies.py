"""What one Llama block keeps from forward to backward under pipeckpt's `selective` and under a policy
equal to torchtitan's op-level selective checkpointing, and what the loss holds with and without the
logits kept until the backward; scaled to Llama 3.1 8B at torchtitan's Table 1 (seq 8192, local
batch 2, bf16, 32 blocks). docs/MEMORY.md ("Per rank under FSDP2, TP and PP") uses the figures to
account for the gap between the 8B plan and torchtitan's published 82.4 GiB.

The model is Hugging Face's ``LlamaForCausalLM`` built from a ``LlamaConfig`` with the 8B's shape
ratios (random weights, nothing downloaded): hidden 512, head dim 128 (4 heads, 1 KV head: 4 query
heads per KV head, as 32/8), intermediate 3.5 x hidden (1792), vocabulary hidden x 128256/4096
(16032), seq 1024, batch 2, bf16. Every tensor a block or the loss makes is a multiple of
``batch x seq x hidden`` (or of ``batch x heads x seq``, ``batch x seq x vocab``), so each figure
times 64 = (2 x 8192 x 4096) / (2 x 1024 x 512) is the 8B's, to the byte.

Bytes are counted as benchmarks/harness/live_bytes.py counts them: every storage an operator makes,
from its creation to its release. "Kept" is what stays alive after the block's forward, less its
output (the next block's input, counted there) and plus its own input (held for the recompute).

Policies, all torch's non-reentrant ``checkpoint`` around one block:
- ``none``: no checkpoint (autograd's saved tensors);
- ``full``: everything recomputed (the block's input kept);
- ``pipeckpt selective``: ``pipeckpt.checkpointing.selective.policy`` (every matmul and attention
  kernel's output);
- ``torchtitan op``: the rule of torchtitan's ``_apply_ac_to_transformer_block`` at the commit of
  its published benchmark (9dec370, 2024-12-26; selective_ac_option "op" in its llama3_8b.toml):
  save the outputs of ``mm`` (except every second ``mm`` of the block, counted afresh per block
  and per pass), the flash and memory-efficient attention kernels, ``reduce_scatter_tensor``,
  ``abs`` and ``max``; recompute the rest. On the CPU the attention kernel is
  ``_scaled_dot_product_flash_attention_for_cpu``, standing for the flash kernel an H100 runs
  (its outputs have the same shapes: the attention output and a fp32 log-sum-exp). Written here
  from that rule, not copied.

    python benchmarks/bench_selective_policies.py

Measured on the shared 2-core Intel Xeon (torch 2.13.0+cpu, transformers 5.24.0), 2026-12-02, one
run (docs/MEMORY.md, "The gap to torchtitan, term by term", uses these figures):

| policy | kept per block, MiB here | bytes per element of sbh | GiB per 8B block | GiB, 32 blocks |
|---|---|---|---|---|
| none | 51.047 | 51.05 | 3.1904 | 102.09 |
| full | 2.000 | 2.00 | 0.1250 | 4.00 |
| pipeckpt selective | 25.031 | 25.03 | 1.5645 | 50.06 |
| torchtitan op | 15.531 | 15.53 | 0.9707 | 31.06 |

pipeckpt selective keeps (here) mm[2048, 512] (q), mm[2048, 128] (k), mm[2048, 128] (v), the
attention kernel's [2, 4, 1024, 128] output and its log-sum-exp, mm[2048, 512] (o), mm[2048, 1792]
(gate), mm[2048, 1792] (up), mm[2048, 512] (down); torchtitan's rule keeps q, v, attention, gate and
down. Difference: 0.5938 GiB per 8B block, 19.00 GiB over 32. Every policy's input gradient is
bitwise equal to no checkpoint's. Norm + head + loss at the 8B's size: 12.24 GiB held after the
loss's forward, 20.07 at its forward's peak, 27.90 at its backward's peak with the logits held until
the backward and 23.98 with them deleted first (torchtitan's step). The pipeckpt figure per block
equals the plan's fake-tensor profile of the 8B's HF block (input 0.125 + kept 1.4395 GiB).
"""

import collections
import time
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.nn.functional as F
from harness.live_bytes import LiveBytes
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
from transformers import LlamaConfig, LlamaForCausalLM

from pipeckpt.checkpointing.selective import policy as pipeckpt_policy

HIDDEN, HEAD_DIM, SEQ, BATCH = 512, 128, 1024, 2
SCALE = (2 * 8192 * 4096) // (BATCH * SEQ * HIDDEN)  # 64
GIB = 2**30
LAYERS_8B = 32


def config() -> LlamaConfig:
    heads = HIDDEN // HEAD_DIM
    return LlamaConfig(
        hidden_size=HIDDEN,
        intermediate_size=HIDDEN * 14336 // 4096,
        num_hidden_layers=3,
        num_attention_heads=heads,
        num_key_value_heads=heads // 4,
        vocab_size=HIDDEN * 128256 // 4096,
        max_position_embeddings=SEQ,
        attn_implementation="sdpa",
    )


_ATTENTION = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention")
_CPU_FLASH = "_scaled_dot_product_flash_attention_for_cpu"  # the CPU's stand-in for the flash kernel


def _torchtitan_saved() -> set:
    names = [*_ATTENTION, _CPU_FLASH, "abs", "max"]
    ops = {getattr(torch.ops.aten, n).default for n in names if hasattr(torch.ops.aten, n)}
    ops.add(torch.ops.aten.mm.default)
    if hasattr(torch.ops, "_c10d_functional"):
        ops.add(torch.ops._c10d_functional.reduce_scatter_tensor.default)
    return ops


def torchtitan_rule() -> Callable[..., CheckpointPolicy]:
    """torchtitan's op rule for one call of one block: a fresh count of ``mm`` per call."""
    saved, counts = _torchtitan_saved(), collections.Counter()

    def rule(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        key = "recompute" if ctx.is_recompute else "forward"
        if func == torch.ops.aten.mm.default:
            counts[key] += 1
        second_mm = func == torch.ops.aten.mm.default and counts[key] % 2 == 0
        return (
            CheckpointPolicy.MUST_SAVE
            if func in saved and not second_mm
            else CheckpointPolicy.PREFER_RECOMPUTE
        )

    return rule


def torchtitan_contexts() -> Tuple[Any, Any]:
    return create_selective_checkpoint_contexts(torchtitan_rule())


def pipeckpt_contexts() -> Tuple[Any, Any]:
    return create_selective_checkpoint_contexts(pipeckpt_policy)


class _KeptOps(torch.utils._python_dispatch.TorchDispatchMode):
    """The ops a forward runs, in order, with their outputs' bytes (to name what a policy keeps)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: List[Tuple[Any, Tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        first = out[0] if isinstance(out, (tuple, list)) else out
        if isinstance(first, torch.Tensor):
            self.ops.append((func, tuple(first.shape)))
        return out


def block_kept(
    layer: torch.nn.Module, x: torch.Tensor, pe: Tuple[torch.Tensor, torch.Tensor], how: str
) -> Tuple[int, torch.Tensor]:
    """Bytes ``layer`` keeps from forward to backward under ``how``, and its input's gradient."""
    x = x.detach().requires_grad_()
    run: Callable[[], torch.Tensor]
    if how == "none":
        run = lambda: layer(x, position_embeddings=pe)  # noqa: E731
    else:
        ctx = {"full": None, "pipeckpt selective": pipeckpt_contexts, "torchtitan op": torchtitan_contexts}[
            how
        ]
        extra: Dict[str, Any] = {} if ctx is None else {"context_fn": ctx}
        run = lambda: checkpoint(layer, x, position_embeddings=pe, use_reentrant=False, **extra)  # noqa: E731
    live = LiveBytes()
    live.count([*layer.parameters(), x, pe])  # views of these (a weight's transpose) are no new memory
    base = live.live
    with live:
        out = run()
    output = out.untyped_storage().nbytes()
    kept = live.live - base - output + x.untyped_storage().nbytes()
    out.float().square().sum().backward()
    assert x.grad is not None
    return kept, x.grad


class _Forward:
    is_recompute = False


def which_kept(
    layer: torch.nn.Module, x: torch.Tensor, pe: Any, rule: Callable[..., CheckpointPolicy]
) -> List[str]:
    """The ops whose outputs ``rule`` keeps, in forward order, with their first output's shape."""
    ops = _KeptOps()
    with torch.no_grad(), ops:
        layer(x, position_embeddings=pe)
    return [
        f"{func.__name__.split('.')[0]}{list(shape)}"
        for func, shape in ops.ops
        if rule(_Forward(), func) == CheckpointPolicy.MUST_SAVE
    ]


def loss_peaks(
    model: LlamaForCausalLM, h: torch.Tensor, labels: torch.Tensor, keep_logits: bool
) -> Dict[str, int]:
    """Bytes the final norm, the head and the loss add above what existed before them: at the end
    of the loss's forward and at the peak of its forward and backward, with the logits held until the
    backward (pipeckpt's distributed engine, torch's PipelineStage) or deleted first (torchtitan's
    step without PP: ``del pred`` before ``loss.backward()``). The loss is torchtitan's,
    ``cross_entropy(pred.flatten(0, 1).float(), labels)``; Hugging Face's ``ForCausalLMLoss`` upcasts
    the same way."""
    h = h.detach().requires_grad_()
    live = LiveBytes()
    live.count([*model.model.norm.parameters(), *model.lm_head.parameters(), h, labels])
    base = live.live
    with live:
        pred = model.lm_head(model.model.norm(h))
        loss = F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))
        forward_peak, after_forward = live.peak - base, live.live - base
        if not keep_logits:
            del pred
        live.peak = live.live
        loss.backward()
        backward_peak = live.peak - base
    return {"after forward": after_forward, "forward peak": forward_peak, "backward peak": backward_peak}


def main() -> None:
    torch.set_num_threads(2)
    torch.manual_seed(0)
    cfg = config()
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    layer = model.model.layers[1]
    x = torch.randn(BATCH, SEQ, HIDDEN, dtype=torch.bfloat16)
    pe = model.model.rotary_emb(x, torch.arange(SEQ).unsqueeze(0))
    print(
        f"HF LlamaDecoderLayer, hidden {HIDDEN}, heads {cfg.num_attention_heads}/{cfg.num_key_value_heads}, "
        f"intermediate {cfg.intermediate_size}, vocab {cfg.vocab_size}, seq {SEQ}, batch {BATCH}, bf16; "
        f"x{SCALE} = Llama 3.1 8B at seq 8192, batch 2"
    )
    sbh = BATCH * SEQ * HIDDEN  # elements of one hidden state
    grads: Dict[str, torch.Tensor] = {}
    kept: Dict[str, int] = {}
    print(
        "| policy | kept per block, MiB here | bytes per element of sbh | GiB per 8B block | GiB, 32 blocks |"
    )
    print("|---|---|---|---|---|")
    for how in ("none", "full", "pipeckpt selective", "torchtitan op"):
        start = time.perf_counter()
        kept[how], grads[how] = block_kept(layer, x, pe, how)
        scaled = kept[how] * SCALE / GIB
        print(
            f"| {how} | {kept[how] / 2**20:.3f} | {kept[how] / sbh:.2f} | {scaled:.4f} | "
            f"{scaled * LAYERS_8B:.2f} |  ({time.perf_counter() - start:.1f} s)"
        )
    for how in grads:
        assert torch.equal(grads[how], grads["none"]), f"{how}: input gradient differs from no checkpoint"
    print("input gradients of every policy bitwise equal to no checkpoint's")
    diff = (kept["pipeckpt selective"] - kept["torchtitan op"]) * SCALE / GIB
    print(
        f"pipeckpt selective - torchtitan op: {diff:.4f} GiB per 8B block, {diff * LAYERS_8B:.2f} GiB over 32"
    )
    for name, rule in (("pipeckpt selective", pipeckpt_policy), ("torchtitan op", torchtitan_rule())):
        print(f"{name} keeps: " + ", ".join(which_kept(layer, x, pe, rule)))
    labels = torch.randint(cfg.vocab_size, (BATCH, SEQ))
    for keep in (True, False):
        peaks = loss_peaks(model, x, labels, keep)
        what = "logits held until backward" if keep else "logits deleted before backward (torchtitan)"
        scaled = ", ".join(f"{k} {v * SCALE / GIB:.2f}" for k, v in peaks.items())
        print(f"norm + head + loss, {what}: GiB at 8B: {scaled}")


if __name__ == "__main__":
    main()
