"""``compile`` modes that replay CUDA graphs (``reduce-overhead``, ``max-autotune``) with the checkpoint
modes: refused with offload (and ``auto``, which may pick it) when the strategy is made, before any
work: offload copies a layer's input to the host asynchronously while the graph's next replay writes
over the memory it lives in. The other modes are taken (tests/test_cuda.py runs them on a GPU)."""

import pytest

from pipeckpt import PipeckptConfigError, PipelineStrategy


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
