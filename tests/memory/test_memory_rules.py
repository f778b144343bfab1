"""The memory model's parts (pipeckpt.memory) against their own rules, no step measured: what the
profile records (saved storages, a backward's held peak, a fake profile equal to the real one, the
clock it times with, a DeferredBatchNorm it leaves alone), what each schedule holds and recomputes and
what recompute adds to the predicted time, optimizer state by optimizer, and the config errors.

The model against measurement (one step of the local engine): tests/memory/test_memory.py.
"""

import pytest
import torch
import torch.nn.functional as F
from harness.memory_models import lm_loss
from harness.memory_models import model_of as _model
from harness.memory_models import profile_of as _profile
from torch import nn

from pipeckpt._compat import DeferredBatchNorm
from pipeckpt._errors import PipeckptConfigError
from pipeckpt.app.models.convnet import convnet_layers
from pipeckpt.app.models.gpt import gpt_layers
from pipeckpt.memory.optimizer_state import optimizer_state_bytes
from pipeckpt.memory.predict import predict
from pipeckpt.memory.profile import fake_mode, profile
from pipeckpt.memory.schedule import op_order
from pipeckpt.stages.batch_norm import convert_deferred_batch_norm
from pipeckpt.stages.partition import plan

CPU = torch.device("cpu")


# -- the profile -----------------------------------------------------------------------------------


def test_the_profile_measures_a_backward_peak_with_the_arriving_gradient_held() -> None:
    # The embedding's backward (token table's gradient) peaks after dropout's node has used the
    # gradient that arrived: held, that gradient (12 x 32 x 64 fp32) adds to the peak exactly.
    torch.manual_seed(0)
    seq = gpt_layers(vocab_size=4096, d_model=64, n_heads=4, n_layers=1, seq_len=32, dropout=0.1)
    x = torch.randint(4096, (12, 32), generator=torch.Generator().manual_seed(0))
    embedding = profile(seq, x, rounds=1).layers[0]
    assert embedding.backward_held_peak - embedding.backward_peak == 12 * 32 * 64 * 4


def test_the_profile_names_what_each_layer_saves() -> None:
    # Linear saves its input; ReLU its output; the Linear after a ReLU saves the same storage
    # again, which a stage's saved set counts once.
    seq = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    fitted = profile(seq, torch.randn(5, 4), rounds=1)
    first, relu, last = fitted.layers
    assert first.saved == fitted.batch_inputs  # the batch's own storage, never counted
    assert relu.saved == relu.outputs and last.saved == relu.outputs
    assert fitted.bytes_of(fitted.saved_union(0, 3)) == 5 * 8 * 4
    assert [layer.param_bytes for layer in fitted.layers] == [(4 * 8 + 8) * 4, 0, (8 * 2 + 2) * 4]


def test_a_fake_profile_equals_the_real_one() -> None:
    def build() -> nn.Sequential:
        return gpt_layers(vocab_size=64, d_model=32, n_heads=2, n_layers=2, seq_len=16, dropout=0.1)

    x, y = torch.randint(64, (2, 16)), torch.randint(64, (2, 16))
    real = profile(build(), x, loss_fn=lm_loss, target=y, rounds=1)
    with fake_mode():
        fake = profile(build(), x, loss_fn=lm_loss, target=y, fake=True)
    fields = ("param_bytes", "saved", "inputs", "outputs", "forward_peak", "backward_peak")
    assert [[getattr(layer, f) for f in fields] for layer in fake.layers] == [
        [getattr(layer, f) for f in fields] for layer in real.layers
    ]
    assert fake.storage_bytes == real.storage_bytes


def test_profile_times_with_process_cpu_time_on_a_one_thread_cpu(monkeypatch) -> None:
    # A machine shared with other jobs inflates the wall clock by every wait for a core.
    import time

    import pipeckpt.memory.timing as memory

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert memory.clock() is time.process_time


def test_profile_times_with_the_wall_clock_when_threads_overlap(monkeypatch) -> None:
    import time

    import pipeckpt.memory.timing as memory

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    assert memory.clock() is time.perf_counter


def test_profiling_a_deferred_batch_norm_leaves_its_selective_time_to_the_estimate() -> None:
    # torchgpipe's DeferredBatchNorm commits statistics in a forward that its recompute skips, which
    # SAC's replay refuses: the profile must neither fail nor time it, and must leave its state alone.
    torch.manual_seed(0)
    layers = convnet_layers(in_channels=3, num_classes=10, width=8)
    convert_deferred_batch_norm(layers, chunks=2)
    before = {k: v.clone() for k, v in layers.state_dict().items()}
    x, y = torch.randn(4, 3, 8, 8), torch.randint(10, (4,))
    fitted = profile(layers, x, loss_fn=F.cross_entropy, target=y, rounds=1)
    deferred = [i for i, m in enumerate(layers) if any(isinstance(n, DeferredBatchNorm) for n in m.modules())]
    assert deferred
    assert all(fitted.layers[i].sac_extra_s is None for i in deferred)
    assert all(torch.equal(before[k], v) for k, v in layers.state_dict().items())


# -- schedules, recompute, optimizer state ---------------------------------------------------------


def test_a_segment_holds_less_than_the_whole_stage_in_backward() -> None:
    # always:1 recomputes one layer at a time: the gpt stage of two blocks peaks lower than always.
    seq, *_ = _model("gpt")
    fitted = _profile("gpt", 2)
    peaks = {
        mode: predict(
            fitted, plan(seq, devices=[CPU], stages=3, checkpoint=mode, chunks=2), chunks=2, optimizer="sgd"
        )
        .stages[1]
        .peak
        for mode in ("always", "always:1")
    }
    assert peaks["always:1"] < peaks["always"], peaks


def test_except_last_keeps_the_micro_batch_the_schedule_backwards_first() -> None:
    # Local: the last micro-batch is kept; GPipe: micro-batch 0; 1F1B's last stage: every one.
    seq, *_ = _model("mlp")
    stage_plan = plan(seq, devices=[CPU], stages=3, checkpoint="except_last", chunks=4)
    got = {
        s: [x.recomputed for x in predict(_profile("mlp", 4), stage_plan, chunks=4, schedule=s).stages]
        for s in ("local", "gpipe", "1f1b")
    }
    assert got == {"local": [3, 3, 3], "gpipe": [3, 3, 3], "1f1b": [3, 3, 0]}


def test_selective_recompute_costs_what_the_profile_measured_sac_to_add() -> None:
    # SAC's cost (its dispatch mode on every op, the checkpoint's hooks) is measured layer by layer,
    # not assumed below a forward: on this dispatch-bound GPT it exceeds the recompute it saves.
    seq, *_ = _model("gpt")
    fitted = _profile("gpt", 2)
    stage_plan = {
        mode: plan(seq, devices=[CPU], stages=3, checkpoint=mode, chunks=2) for mode in ("never", "selective")
    }
    times = {
        mode: predict(fitted, p, chunks=2, optimizer="sgd").stages[1].time_s for mode, p in stage_plan.items()
    }
    start, stop = stage_plan["never"].ranges[1]
    extra = [layer.sac_extra_s for layer in fitted.layers[start:stop]]
    assert all(e is not None and e >= 0 for e in extra), extra
    assert times["selective"] - times["never"] == pytest.approx(2 * sum(extra), rel=1e-9, abs=1e-12)


def test_gpipe_holds_every_micro_batch_and_1f1b_at_most_stages_minus_i() -> None:
    seq, *_ = _model("mlp")
    stage_plan = plan(seq, devices=[CPU], stages=3, checkpoint="never", chunks=4)
    fitted = _profile("mlp", 4)
    gpipe = predict(fitted, stage_plan, chunks=4, optimizer="sgd", schedule="gpipe")
    one_f_one_b = predict(fitted, stage_plan, chunks=4, optimizer="sgd", schedule="1f1b")
    assert [s.in_flight for s in gpipe.stages] == [4, 4, 4]
    assert [s.in_flight for s in one_f_one_b.stages] == [3, 2, 1]


def test_op_orders_come_from_the_schedule() -> None:
    local, _ = op_order("local", stages=2, microbatches=3)
    assert local[0] == [("F", 0), ("F", 1), ("F", 2), ("B", 2), ("B", 1), ("B", 0)]
    gpipe, source = op_order("gpipe", stages=2, microbatches=3)
    assert gpipe[1] == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("B", 1), ("B", 2)]
    assert "IR" in source
    ofob, _ = op_order("1f1b", stages=2, microbatches=3)
    assert ofob == [
        [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("B", 2)],
        [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)],
    ]


def test_except_last_recomputes_all_but_one_and_always_costs_one_forward_each() -> None:
    seq, *_ = _model("mlp")
    fitted = _profile("mlp", 4)
    times = {}
    for mode in ("never", "except_last", "always"):
        p = predict(
            fitted, plan(seq, devices=[CPU], stages=3, checkpoint=mode, chunks=4), chunks=4, optimizer="sgd"
        )
        assert [s.recomputed for s in p.stages] == [{"never": 0, "except_last": 3, "always": 4}[mode]] * 3
        times[mode] = [s.time_s for s in p.stages]
    forward = [
        sum(layer.forward_s for layer in fitted.layers[a:b])
        for a, b in plan(seq, devices=[CPU], stages=3).ranges
    ]
    for j in range(3):
        assert times["always"][j] - times["never"][j] == pytest.approx(4 * forward[j], rel=1e-9)


def test_accumulating_gradients_count_from_the_first_op() -> None:
    seq, *_ = _model("mlp")
    stage_plan = plan(seq, devices=[CPU], stages=3, checkpoint="never", chunks=2)
    fresh = predict(_profile("mlp", 2), stage_plan, chunks=2, optimizer="sgd")
    held = predict(_profile("mlp", 2), stage_plan, chunks=2, optimizer="sgd", accumulating=True)
    assert all(h.peak >= f.peak for h, f in zip(held.stages, fresh.stages))


def test_optimizer_state_follows_the_optimizer_type() -> None:
    assert optimizer_state_bytes("sgd", 1000, 3) == 0
    assert optimizer_state_bytes("momentum", 1000, 3) == 1000
    assert optimizer_state_bytes("adam", 1000, 3) == 2000 + 4 * 3
    model = nn.Linear(3, 2)
    assert optimizer_state_bytes(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), 32, 2) == 32


def test_adam_state_as_predicted_is_what_adam_allocates() -> None:
    seq, *_ = _model("mlp")
    params = [p.detach().clone().requires_grad_() for p in seq.parameters()]
    adam = torch.optim.Adam(params)
    for p in params:
        p.grad = torch.zeros_like(p)
    adam.step()
    state = sum(t.numel() * t.element_size() for s in adam.state.values() for t in s.values())
    nbytes = sum(p.numel() * p.element_size() for p in params)
    assert optimizer_state_bytes("adam", nbytes, len(params)) == state


def test_a_profile_of_other_layers_is_a_config_error() -> None:
    seq, *_ = _model("mlp")
    other = plan(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), devices=[CPU], stages=2)
    with pytest.raises(PipeckptConfigError, match="the profile has 9 layers"):
        predict(_profile("mlp", 1), other, chunks=1)
    del seq


def test_an_unknown_schedule_is_a_config_error() -> None:
    with pytest.raises(PipeckptConfigError, match="schedule='zbv'"):
        op_order("zbv", stages=2, microbatches=2)
