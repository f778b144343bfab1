"""CUDA behaviour: placement on several GPUs, and offload to pinned host memory on side streams
(copies ordered against the compute stream; saved bytes off the GPU; gradients as ``never``).
Skipped where no GPU is present (CI has none); run on a GPU machine. Step time of offload is a
benchmark (benchmarks/bench_gpu.py), not a test."""

from typing import Any, Dict, List, Tuple

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from support.toy import ToyModule, fit, max_relative_difference, params, toy_layers

from pipeckpt import PipelineStrategy
from pipeckpt.app.models.gpt import gpt_layers
from pipeckpt.checkpointing.offload import CudaCopies, copies_for
from pipeckpt.engines.local.pipeline import LocalPipeline
from pipeckpt.stages.partition import plan

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def gpus() -> list:
    return [torch.device("cuda", i) for i in range(min(torch.cuda.device_count(), 2))]


class Placement(L.Callback):
    """Where each stage's parameters are while training (after fit, teardown puts the module on
    the CPU, as for every Lightning strategy)."""

    def __init__(self) -> None:
        self.seen: list = []

    def on_train_batch_end(self, trainer, *args) -> None:
        self.seen = [
            (stage.device, {p.device for p in stage.parameters()}) for stage in trainer.strategy.stages
        ]


@pytest.mark.parametrize(
    "devices, settings, expected",
    [
        (1, dict(stages=1), [0]),
        (1, dict(stages=3), [0, 0, 0]),  # more stages than GPUs: all share the one
        (2, dict(stages=2), [0, 1]),
        (2, dict(stages=3, placement=[0, 0, 1]), [0, 0, 1]),
        (2, dict(balance=[3, 3]), [0, 1]),
        (2, dict(), [0, 1]),  # one stage per device
    ],
    ids=["1gpu-1stage", "1gpu-3stages", "2gpus-2stages", "2gpus-placement", "2gpus-balance", "2gpus-default"],
)
def test_each_stage_trains_on_the_gpu_it_was_given(devices, settings, expected):
    if torch.cuda.device_count() < devices:
        pytest.skip(f"needs {devices} GPUs")
    placement = Placement()
    trainer = fit(
        ToyModule(),
        PipelineStrategy(chunks=2, **settings),
        steps=1,
        accelerator="gpu",
        devices=devices,
        callbacks=[placement],
    )
    assert [device for device, _ in placement.seen] == [torch.device("cuda", i) for i in expected]
    for device, held in placement.seen:
        assert held == {device}
    assert trainer.strategy.root_device == torch.device("cuda", expected[-1])


def test_training_on_gpu_matches_cpu_to_1e_4():
    cpu = params(fit(ToyModule(), PipelineStrategy(balance=[3, 3], chunks=4), steps=3).lightning_module)
    gpu = params(
        fit(
            ToyModule(),
            PipelineStrategy(balance=[3, 3], chunks=4, placement=[0, 0]),
            steps=3,
            accelerator="gpu",
            devices=1,
        ).lightning_module
    )
    assert max_relative_difference(gpu, cpu) < 1e-4


def kept_after_forward(mode: str) -> int:
    """CUDA bytes still allocated after forward, minus the parameters."""
    torch.manual_seed(0)
    seq = toy_layers(width=1024, depth=6).cuda()
    engine = LocalPipeline(
        seq, plan(seq, devices=[torch.device("cuda", 0)], balance=[2, 2, 2], checkpoint=mode), chunks=4
    )
    x = torch.randn(512, 8, device="cuda")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = engine.forward(x)
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - before
    out.sum().backward()
    return kept


def test_offload_keeps_less_on_the_gpu_than_always():
    always, offload = kept_after_forward("always"), kept_after_forward("offload")
    # Each stage after the first keeps a 512x1024 fp32 input per micro-batch on the
    # GPU under 'always' (2 MiB in total per stage); 'offload' keeps it on the host.
    assert always - offload >= 2 * 512 * 1024 * 4 * 0.9


# -- offload on side streams (pipeckpt/checkpointing/offload.py) ---------------------------------------------

CUDA0 = torch.device("cuda", 0)


def busy(n: int = 2048, rounds: int = 20) -> torch.Tensor:
    """A result the compute stream takes milliseconds to produce: a copy that did not wait for
    it would read memory not yet written."""
    a = torch.randn(n, n, device=CUDA0)
    for _ in range(rounds):
        a = torch.tanh(a @ a / n)
    return a


def test_the_cuda_copy_layer_runs_on_two_side_streams_of_the_stage_gpu():
    copies = copies_for(CUDA0)
    assert isinstance(copies, CudaCopies) and copies_for(CUDA0) is copies  # one pair per GPU
    streams = {copies.out_stream, copies.in_stream, torch.cuda.current_stream(CUDA0)}
    assert len(streams) == 3
    assert copies.out_stream.device == copies.in_stream.device == CUDA0


def test_a_copy_out_waits_for_the_compute_stream_and_lands_in_pinned_host_memory():
    copies = CudaCopies(CUDA0)
    x = busy()
    stored = copies.to_host(x, pin_memory=True)
    torch.cuda.synchronize()
    assert stored.host.device == torch.device("cpu") and stored.host.is_pinned()
    assert torch.equal(stored.host, x.cpu())


def test_the_compute_stream_waits_for_a_copy_back_before_using_it():
    copies = CudaCopies(CUDA0)
    x = busy()
    expected = x.cpu() * 2
    fetched = copies.to_device(copies.to_host(x, pin_memory=True), CUDA0)
    used = copies.use(fetched)
    doubled = used * 2  # on the compute stream, issued at once
    assert torch.equal(doubled.cpu(), expected)


def test_an_offloading_cuda_stage_keeps_its_inputs_in_pinned_host_memory():
    seq = toy_layers(width=64, depth=4).cuda()
    engine = LocalPipeline(seq, plan(seq, devices=[CUDA0], balance=[2, 2], checkpoint="offload"), chunks=2)
    out = engine.forward(torch.randn(8, 8, device=CUDA0))
    torch.cuda.synchronize()
    nodes = [n for n in graph_nodes(out.grad_fn) if getattr(n, "offloaded", None) is not None]
    assert len(nodes) == 4  # 2 stages x 2 micro-batches
    for node in nodes:
        (stored,) = node.offloaded.stored
        assert stored.host.is_pinned() and stored.done is not None
    out.sum().backward()


def graph_nodes(root: Any) -> List[Any]:
    seen, todo, found = set(), [root], []
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        found.append(node)
        todo.extend(next_fn for next_fn, _ in node.next_functions)
    return found


def gpt_step(mode: str) -> Tuple[int, int, int, Dict[str, torch.Tensor]]:
    """One forward and backward of a small GPT over 3 stages x 4 micro-batches on GPU 0, dropout
    on: CUDA bytes kept after forward and the peak during the step (both above what was
    allocated before), the same kept by a forward without grad (its logits), and the gradients."""
    # Activations outweigh parameters (each layer input is 2 MiB per micro-batch, 80 MiB in all
    # under always:1; the gradients 6 MiB), so a peak late in backward, where the gradients have
    # grown, cannot hide what offload saved early in it.
    torch.manual_seed(0)
    seq = gpt_layers(vocab_size=256, d_model=128, n_heads=4, n_layers=8, seq_len=512, dropout=0.1).to(CUDA0)
    engine = LocalPipeline(seq, plan(seq, devices=[CUDA0], balance=[3, 4, 4], checkpoint=mode), chunks=4)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (32, 513), generator=g).to(CUDA0)
    x, y = tokens[:, :-1], tokens[:, 1:]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with torch.no_grad():
        logits = engine.forward(x)
    torch.cuda.synchronize()
    logits_only = torch.cuda.memory_allocated() - before
    del logits
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(2)
    loss = F.cross_entropy(engine.forward(x).flatten(0, 1), y.flatten())
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - before
    loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    return kept, peak, logits_only, {k: p.grad.detach().clone() for k, p in seq.named_parameters()}


def test_per_layer_offload_moves_at_least_half_the_saved_activation_bytes_off_the_gpu():
    kept_always, peak_always, logits, _ = gpt_step("always:1")
    kept_offload, peak_offload, _, _ = gpt_step("offload:1")
    saved = kept_always - logits  # every layer's input per micro-batch, kept by always:1
    assert saved > 40 * 2**20, f"the model keeps too little to measure: {saved} bytes"
    assert kept_always - kept_offload >= 0.5 * saved, (kept_always, kept_offload, saved)
    assert peak_always - peak_offload >= 0.5 * saved, (peak_always, peak_offload, saved)


@pytest.mark.parametrize("mode", ["offload", "offload:1"])
def test_offload_on_a_gpu_gives_the_gradients_of_never_to_1e_6(mode):
    *_, never = gpt_step("never")
    *_, offloaded = gpt_step(mode)
    assert max_relative_difference(offloaded, never) <= 1e-6


def compiled_fit(checkpoint: Any, compile: Any) -> Dict[str, torch.Tensor]:
    """Parameters after 3 steps of the toy model on GPU 0, 2 stages x 2 micro-batches."""
    strategy = PipelineStrategy(balance=[3, 3], chunks=2, checkpoint=checkpoint, compile=compile)
    return params(fit(ToyModule(), strategy, steps=3, accelerator="gpu").lightning_module)


@pytest.mark.parametrize("mode", ["selective", "selective:1"])
def test_compiled_selective_under_inductor_trains_as_never_to_1e_4(mode):
    # inductor fuses kernels: not bitwise (aot_eager is, tests/checkpointing/test_compile_selective.py)
    assert max_relative_difference(compiled_fit(mode, True), compiled_fit("never", False)) <= 1e-4


@pytest.mark.parametrize("mode", ["never", "except_last", "always", "always:1", "selective"])
def test_reduce_overhead_trains_as_eager_to_1e_4_with_every_mode_it_takes(mode):
    # CUDA graphs replay each layer's kernels; offload is refused with them (checkpointing/compiling.py)
    assert max_relative_difference(compiled_fit(mode, "reduce-overhead"), compiled_fit(mode, False)) <= 1e-4


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("mode", ["never", "except_last", "always"])
def test_the_memory_model_predicts_one_gpus_step_within_ten_percent_of_max_memory_allocated(mode, precision):
    # All stages on the one GPU: the model's peak for the device against the allocator's, the profile
    # taken on the GPU under the step's autocast as auto and the plan command take it.
    from harness.stage_memory import measure_device_step

    from pipeckpt.memory.auto import process_peak
    from pipeckpt.memory.precision import forward_context
    from pipeckpt.memory.profile import profile

    torch.manual_seed(0)
    seq = gpt_layers(vocab_size=256, d_model=128, n_heads=4, n_layers=8, seq_len=512, dropout=0.0).to(CUDA0)
    tokens = torch.randint(0, 256, (32, 513), generator=torch.Generator().manual_seed(1)).to(CUDA0)
    x, y = tokens[:, :-1], tokens[:, 1:]

    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.flatten(0, 1).float(), target.flatten())

    region = lambda: forward_context(precision, CUDA0)  # noqa: E731
    with region():
        fitted = profile(seq, x.chunk(4)[0], loss_fn=loss, target=y.chunk(4)[0], rounds=1)
    stage_plan = plan(seq, devices=[CUDA0], balance=[3, 4, 4], checkpoint=mode, chunks=4)
    predicted = process_peak(fitted, stage_plan, chunks=4, optimizer="sgd")
    measured = measure_device_step(
        seq, stage_plan, chunks=4, batch=x, loss_fn=lambda out: loss(out, y), forward_context=region
    )
    assert predicted == pytest.approx(measured, rel=0.10)
