"""``compile`` modes that replay CUDA graphs (``reduce-overhead``, ``max-autotune``) with the checkpoint
modes: refused with offload (and ``auto``, which may pick it) when the strategy is made, before any
work: offload copies a layer's input to the host asynchronously while the graph's next replay writes
over the memory it lives in. The other modes are taken (tests/test_cuda.py runs them on a GPU), each
compiled layer handing out copies of its graph's outputs."""

from typing import Dict, Tuple

import pytest
import torch

from pipeckpt import PipeckptConfigError, PipelineStrategy
from pipeckpt.checkpointing.compiling import compile_layers, recomputed_layers, uncompile_layers
from pipeckpt.checkpointing.modes import ALWAYS, NEVER


@pytest.mark.parametrize("compile", ["reduce-overhead", "max-autotune"])
@pytest.mark.parametrize("checkpoint", ["offload", "offload:1", ["never", "offload"]])
def test_a_cuda_graph_compile_mode_with_offload_is_refused_naming_both(compile, checkpoint):
    with pytest.raises(PipeckptConfigError, match=rf"compile='{compile}' with checkpoint=.*offload.*HINT"):
        PipelineStrategy(stages=2, chunks=2, checkpoint=checkpoint, compile=compile)


def test_a_cuda_graph_compile_mode_with_auto_is_refused_as_auto_may_pick_offload():
    with pytest.raises(PipeckptConfigError, match=r"checkpoint=auto.*may pick offload"):
        PipelineStrategy(
            stages=2, chunks=2, checkpoint="auto", memory_budget="1GiB", compile="reduce-overhead"
        )


@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always", "always:1", "selective"])
def test_a_cuda_graph_compile_mode_is_taken_with_the_modes_that_do_not_offload(checkpoint):
    assert PipelineStrategy(stages=2, chunks=2, checkpoint=checkpoint, compile="reduce-overhead")


def test_compile_without_cuda_graphs_is_taken_with_offload():
    assert PipelineStrategy(stages=2, chunks=2, checkpoint="offload", compile="max-autotune-no-cudagraphs")


class _PassThrough(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, None, Dict[str, torch.Tensor]]:
        return x, None, {"twice": x * 2}


@pytest.mark.parametrize("grad", [False, True])
def test_a_layer_compiled_for_cuda_graphs_hands_out_copies_of_what_its_graph_returns(grad):
    # A CUDA-graph tree replays over its last outputs while the pipeline still holds them (a checkpointed
    # stage's forward runs without gradients): the layer's outputs are cloned out of the graph's pool.
    layers = torch.nn.Sequential(_PassThrough())
    compile_layers(layers, "reduce-overhead")
    x = torch.randn(3, 4, requires_grad=True)
    try:
        with torch.set_grad_enabled(grad):
            out, none, side = layers[0](x)
    finally:
        uncompile_layers(layers)
    assert none is None and torch.equal(out, x) and torch.equal(side["twice"], x * 2)
    assert out.data_ptr() != x.data_ptr()  # a copy, not the tensor the graph returned


def test_a_recomputing_stages_layers_compile_without_cuda_graphs():
    # Each recompute would start a graph tree's new step inside the pipeline's backward (compiling.py).
    layers = torch.nn.Sequential(_PassThrough(), _PassThrough())
    compile_layers(layers, "reduce-overhead", recomputed=recomputed_layers([(0, 1), (1, 2)], [ALWAYS, NEVER]))
    x = torch.randn(3, 4)
    try:
        recomputed, graphed = layers[0](x)[0], layers[1](x)[0]
    finally:
        uncompile_layers(layers)
    assert recomputed.data_ptr() == x.data_ptr() and graphed.data_ptr() != x.data_ptr()
