"""The checkpoint benchmark's subjects: the model's config and the methods it compares.

:func:`build_methods` builds, on one GPT-2-small-sized decoder, every way of running its forward
and backward that ``bench_checkpoint.py`` measures: plain training, a plain micro-batch loop,
``torch.utils.checkpoint`` per block, torchgpipe's ``GPipe`` in its three modes, and pipeckpt's
local engine in each mode plus one per-stage mix. Apart from the measuring and the report because
other benchmarks (bench_frontier.py, bench_perblock_match.py) run the same methods on the same
configs and import them from here (re-exported by bench_checkpoint.py).
"""

from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple

import torch
import torch.nn.functional as F
import torchgpipe
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from pipeckpt.app.models.gpt import gpt_layers
from pipeckpt.engines.local.pipeline import LocalPipeline
from pipeckpt.stages.partition import plan

CPU = torch.device("cpu")
# Plain SGD: the optimizer step is inside the timed region but stays small and
# state-free, so the ratios speak about forward and backward.
LR = 1e-4


@dataclass(frozen=True)
class Config:
    vocab_size: int
    d_model: int
    n_heads: int
    n_layers: int
    seq_len: int
    batch: int
    chunks: int
    stages: int
    dropout: float = 0.1

    def layers(self) -> nn.Sequential:
        return gpt_layers(
            vocab_size=self.vocab_size,
            d_model=self.d_model,
            n_heads=self.n_heads,
            n_layers=self.n_layers,
            seq_len=self.seq_len,
            dropout=self.dropout,
        )

    @property
    def balance(self) -> List[int]:
        """Layer counts as equal as possible, larger first: 15 layers over 4 is [4, 4, 4, 3]."""
        base, extra = divmod(self.n_layers + 3, self.stages)
        return [base + (1 if j < extra else 0) for j in range(self.stages)]


FULL = Config(vocab_size=8192, d_model=768, n_heads=12, n_layers=12, seq_len=128, batch=4, chunks=4, stages=4)
QUICK = Config(vocab_size=256, d_model=64, n_heads=4, n_layers=4, seq_len=32, batch=4, chunks=4, stages=4)

# The per-stage mix: recompute where activations wait longest (the early stages wait for
# the whole drain), keep the last stage, whose backward starts at once.
MIX = ("always", "always", "except_last", "never")


Probe = Callable[[Tensor], None]
ForwardBackward = Callable[[Tensor, Tensor, Probe], Tensor]


@dataclass
class Method:
    key: str
    label: str
    family: str  # plain / torch / torchgpipe / pipeckpt
    mode: Optional[str]  # the checkpoint mode where one applies
    run: ForwardBackward  # forward + backward; probe(loss) between the two
    peers: Tuple[str, ...] = ()  # keys of the methods this one is compared with
    one_forward: bool = True  # False: forwards and backwards interleave (no "held")
    held_mib: Optional[float] = None
    peak_mib: Optional[float] = None
    categories_mib: Optional[float] = None
    footprint_mib: Optional[float] = None
    accumulating_mib: Optional[float] = None
    wall: List[float] = field(default_factory=list)
    cpu: List[float] = field(default_factory=list)
    wall_ratios: List[float] = field(default_factory=list)
    cpu_ratios: List[float] = field(default_factory=list)


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def whole_batch(forward: Callable[[Tensor], Tensor]) -> ForwardBackward:
    def run(x: Tensor, y: Tensor, probe: Probe) -> Tensor:
        loss = lm_loss(forward(x), y)
        probe(loss)
        loss.backward()
        return loss.detach()

    return run


def micro_batch_loop(model: nn.Sequential, chunks: int) -> ForwardBackward:
    def run(x: Tensor, y: Tensor, probe: Probe) -> Tensor:
        total = torch.zeros(())
        for xs, ys in zip(x.chunk(chunks), y.chunk(chunks)):
            loss = lm_loss(model(xs), ys) / chunks
            probe(loss)
            loss.backward()
            total += loss.detach()
        return total

    return run


def per_block(model: nn.Sequential) -> Callable[[Tensor], Tensor]:
    """``torch.utils.checkpoint`` (non-reentrant) around each transformer block."""
    first, *blocks, norm, head = model

    def forward(x: Tensor) -> Tensor:
        h = first(x)
        for block in blocks:
            h = checkpoint(block, h, use_reentrant=False)
        return head(norm(h))

    return forward


def build_methods(model: nn.Sequential, cfg: Config) -> List[Method]:
    methods = [
        Method("plain", "plain, no checkpointing", "plain", None, whole_batch(model)),
        Method(
            "loop",
            f"plain, {cfg.chunks} micro-batches in a loop (grad. accumulation)",
            "plain",
            None,
            micro_batch_loop(model, cfg.chunks),
            one_forward=False,
        ),
        Method(
            "per-block",
            "`torch.utils.checkpoint` per block (non-reentrant)",
            "torch",
            "always",
            whole_batch(per_block(model)),
        ),
    ]
    for mode in ("never", "except_last", "always"):
        gpipe = torchgpipe.GPipe(
            model, cfg.balance, devices=[CPU] * cfg.stages, chunks=cfg.chunks, checkpoint=mode
        )
        methods.append(
            Method(f"torchgpipe-{mode}", f"torchgpipe {mode}", "torchgpipe", mode, whole_batch(gpipe))
        )
    for spec in ("never", "except_last", "always", "offload", MIX):
        key = spec if isinstance(spec, str) else "mix"
        name = spec if isinstance(spec, str) else "mix " + "/".join(spec)
        stage_plan = plan(model, devices=[CPU], balance=cfg.balance, checkpoint=spec, chunks=cfg.chunks)
        engine = LocalPipeline(model, stage_plan, chunks=cfg.chunks, pin_memory=False)
        peers = {
            "never": ("torchgpipe-never",),
            "except_last": ("torchgpipe-except_last",),
            "always": ("torchgpipe-always", "per-block"),
        }.get(key, ())
        methods.append(
            Method(
                f"pipeckpt-{key}",
                f"**pipeckpt {name}**",
                "pipeckpt",
                key,
                whole_batch(engine.forward),
                peers=peers,
            )
        )
    return methods
