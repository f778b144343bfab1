"""pipeckpt.memory.auto.choose: the fastest predicted plan under a budget, checked against brute force."""

import itertools

import pytest
import torch
import torch.nn.functional as F
from harness.stage_memory import StageTracker, measure_local_step, split_batch

from pipeckpt._errors import PipeckptConfigError
from pipeckpt.app.models.gpt import gpt_layers
from pipeckpt.app.models.mlp import mlp_layers
from pipeckpt.engines.local.pipeline import LocalPipeline
from pipeckpt.memory.auto import DEFAULT_MODES, choose, parse_bytes, process_peak, with_balance_modes
from pipeckpt.memory.predict import predict, with_balance
from pipeckpt.memory.profile import profile
from pipeckpt.stages.partition import StagePlan, plan

CPU = torch.device("cpu")


def _mlp():
    torch.manual_seed(0)
    seq = mlp_layers(in_features=32, hidden=128, depth=4, num_classes=10)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(48, 32, generator=g), torch.randint(10, (48,), generator=g)
    return seq, x, y


SEQ, X, Y = _mlp()
PROFILES = {
    c: profile(SEQ, split_batch(X, c), loss_fn=F.cross_entropy, target=split_batch(Y, c), rounds=1)
    for c in (2, 4)
}
BALANCE = (3, 2, 4)
# Plain SGD keeps no state and makes no step temporaries, so the budgets that separate the modes
# are set by activations (Adam's step, twice the largest weight, would be every mode's peak here).
OPTIMIZER = "sgd"


def _plan(balance, modes) -> StagePlan:
    return with_balance(with_balance_modes(balance, DEFAULT_MODES[0]), balance, modes)


def _brute_force(budget, chunk_options, balances):
    """The least step time over every (chunks, balance, mode per stage) whose stages all fit."""
    best = None
    for c in chunk_options:
        for b in balances:
            for modes in itertools.product(DEFAULT_MODES, repeat=len(b)):
                p = predict(PROFILES[c], _plan(b, modes), chunks=c, optimizer=OPTIMIZER)
                if p.peak <= budget and (best is None or p.step_time_s < best):
                    best = p.step_time_s
    return best


def _budgets(chunk_options, balances):
    """Budgets at and between every per-stage peak any plan has: each one changes what fits."""
    peaks = set()
    for c in chunk_options:
        for b in balances:
            for mode in DEFAULT_MODES:
                peaks.update(
                    s.peak
                    for s in predict(
                        PROFILES[c], _plan(b, (mode,) * len(b)), chunks=c, optimizer=OPTIMIZER
                    ).stages
                )
    peaks = sorted(peaks)
    return peaks + [(a + b) // 2 for a, b in itertools.pairwise(peaks)]


def test_modes_chosen_per_stage_are_as_fast_as_brute_force_finds_at_every_budget() -> None:
    checked = 0
    for budget in _budgets([4], [BALANCE]):
        expected = _brute_force(budget, [4], [BALANCE])
        if expected is None:
            with pytest.raises(PipeckptConfigError):
                choose(PROFILES[4], budget, balance=BALANCE, chunks=4, optimizer=OPTIMIZER)
            continue
        got = choose(PROFILES[4], budget, balance=BALANCE, chunks=4, optimizer=OPTIMIZER)
        assert got.prediction.peak <= budget
        assert got.prediction.step_time_s == pytest.approx(expected, rel=1e-12), budget
        checked += 1
    assert checked >= 3  # the sweep reached budgets where something, but not everything, fits


def test_chunks_and_balance_searched_are_as_fast_as_brute_force_finds() -> None:
    balances = [(3, 2, 4), (4, 2, 3), (2, 4, 3)]
    for budget in _budgets([2, 4], balances)[::3]:
        expected = _brute_force(budget, [2, 4], balances)
        if expected is None:
            continue
        got = choose(PROFILES, budget, balance=BALANCE, chunks=[2, 4], balances=balances, optimizer=OPTIMIZER)
        assert got.prediction.step_time_s == pytest.approx(expected, rel=1e-12), budget
        assert got.chunks in (2, 4) and got.balance in balances


def test_an_infeasible_budget_names_the_smallest_feasible_one_and_its_stage() -> None:
    need = max(
        min(predict(PROFILES[4], _plan(BALANCE, (m,) * 3), chunks=4).stages[j].peak for m in DEFAULT_MODES)
        for j in range(3)
    )
    with pytest.raises(
        PipeckptConfigError, match=rf"smallest feasible budget is .* \({need} bytes\), decided by stage"
    ):
        choose(PROFILES[4], need - 1, balance=BALANCE, chunks=4)
    assert choose(PROFILES[4], need, balance=BALANCE, chunks=4).prediction.peak <= need


def test_an_infeasible_budgets_hint_names_the_python_argument_and_the_app_key() -> None:
    with pytest.raises(PipeckptConfigError) as refused:
        choose(PROFILES[4], 1, balance=BALANCE, chunks=4)
    hint = str(refused.value).split(". HINT: ", 1)[1]
    assert hint.startswith("raise memory_budget (memory.budget in the app) to at least "), hint


def test_the_chosen_plan_stays_within_the_budget_as_measured() -> None:
    torch.manual_seed(0)
    seq = gpt_layers(vocab_size=256, d_model=64, n_heads=4, n_layers=4, seq_len=32, dropout=0.1)
    x, y = torch.randint(256, (8, 32)), torch.randint(256, (8, 32))

    def loss(out, target):
        return F.cross_entropy(out.flatten(0, 1), target.flatten())

    fitted = profile(seq, split_batch(x, 4), loss_fn=loss, target=split_batch(y, 4), rounds=1)
    balance = (2, 2, 3)
    never = predict(fitted, _plan(balance, (DEFAULT_MODES[0],) * 3), chunks=4, optimizer="sgd")
    budget = int(0.8 * never.peak)  # too small for never everywhere
    chosen = choose(fitted, budget, balance=balance, chunks=4, optimizer="sgd")
    assert any(m.checkpoints for m in chosen.modes)
    measured, _ = measure_local_step(
        seq, _plan(balance, chosen.modes), chunks=4, batch=x, loss_fn=lambda out: loss(out, y)
    )
    assert max(measured) <= budget, (measured, budget, [m.name for m in chosen.modes])


def test_budgets_parse_with_units() -> None:
    assert parse_bytes("2GiB") == 2 * 2**30
    assert parse_bytes("512 MiB") == 512 * 2**20
    assert parse_bytes("1.5GB") == 1_500_000_000
    assert parse_bytes(4096) == 4096
    with pytest.raises(PipeckptConfigError, match="'2 parsecs': is not a size"):
        parse_bytes("2 parsecs")


def test_modes_that_do_not_nest_are_searched_exhaustively_and_match_brute_force(monkeypatch) -> None:
    import pipeckpt.memory.auto as auto

    monkeypatch.setattr(auto, "_nested", lambda modes, chunks: False)  # as granularity modes would be
    for budget in _budgets([4], [BALANCE])[::2]:
        expected = _brute_force(budget, [4], [BALANCE])
        if expected is None:
            continue
        got = choose(PROFILES[4], budget, balance=BALANCE, chunks=4, optimizer=OPTIMIZER)
        assert got.prediction.step_time_s == pytest.approx(expected, rel=1e-12), budget


def test_the_infeasible_error_names_the_largest_term_of_the_deciding_stage() -> None:
    from pipeckpt.memory.auto import TERMS

    least = [
        min(
            (predict(PROFILES[4], _plan(BALANCE, (m,) * 3), chunks=4).stages[j] for m in DEFAULT_MODES),
            key=lambda s: s.peak,
        )
        for j in range(3)
    ]
    decisive = max(least, key=lambda s: s.peak)
    term = max(TERMS, key=lambda t: getattr(decisive, t))
    with pytest.raises(PipeckptConfigError) as error:
        choose(PROFILES[4], decisive.peak - 1, balance=BALANCE, chunks=4)
    assert f"decided by stage {decisive.stage} " in str(error.value)
    assert f"whose largest term is {term} " in str(error.value)


# -- one device for every stage (shared_device): the budget is the whole process's ---------------


@pytest.fixture(scope="module")
def one_device_plans():
    """(modes, process peak, step time) of every per-stage mode combination, all stages on one CPU."""
    out = []
    for modes in itertools.product(DEFAULT_MODES, repeat=len(BALANCE)):
        p = _plan(BALANCE, modes)
        whole = process_peak(PROFILES[4], p, chunks=4, optimizer=OPTIMIZER)
        step = predict(PROFILES[4], p, chunks=4, optimizer=OPTIMIZER, shared_device=True).step_time_s
        out.append((modes, whole, step))
    return out


def test_one_device_choice_is_as_fast_as_brute_force_under_the_whole_process_peak(one_device_plans) -> None:
    peaks = sorted({whole for _, whole, _ in one_device_plans})
    budgets = [*peaks[:: max(1, len(peaks) // 12)], peaks[-1]]
    checked = 0
    for budget in budgets:
        expected = min(step for _, whole, step in one_device_plans if whole <= budget)
        got = choose(PROFILES[4], budget, balance=BALANCE, chunks=4, shared_device=True, optimizer=OPTIMIZER)
        assert got.process_peak is not None and got.process_peak <= budget
        assert got.process_peak == process_peak(
            PROFILES[4], _plan(BALANCE, got.modes), chunks=4, optimizer=OPTIMIZER
        )
        assert got.prediction.step_time_s == pytest.approx(expected, rel=1e-12), budget
        checked += 1
    assert checked >= 10


def test_one_device_infeasible_budget_names_the_least_whole_process_peak(one_device_plans) -> None:
    least = min(whole for _, whole, _ in one_device_plans)
    with pytest.raises(PipeckptConfigError, match=rf"smallest feasible budget is .* \({least} bytes\)"):
        choose(PROFILES[4], least - 1, balance=BALANCE, chunks=4, shared_device=True, optimizer=OPTIMIZER)
    assert (
        choose(
            PROFILES[4], least, balance=BALANCE, chunks=4, shared_device=True, optimizer=OPTIMIZER
        ).process_peak
        == least
    )


def test_one_device_predicts_only_the_combinations_faster_than_the_first_that_fits(
    one_device_plans, monkeypatch
) -> None:
    # Walked fastest first: at a budget the fastest combination fits, one is predicted, however many
    # there are (8 stages of 4 options were refused at 65,536); a budget nothing fits sees them all.
    import pipeckpt.memory.auto as auto

    monkeypatch.setattr(auto, "MAX_COMBINATIONS", 1)
    roomy = max(whole for _, whole, _ in one_device_plans)
    fastest = min(step for _, _, step in one_device_plans)
    got = choose(PROFILES[4], roomy, balance=BALANCE, chunks=4, shared_device=True, optimizer=OPTIMIZER)
    assert got.prediction.step_time_s == pytest.approx(fastest, rel=1e-12)
    least = min(whole for _, whole, _ in one_device_plans)
    with pytest.raises(PipeckptConfigError, match="per-stage mode combinations"):
        choose(PROFILES[4], least - 1, balance=BALANCE, chunks=4, shared_device=True, optimizer=OPTIMIZER)


@pytest.mark.parametrize("chunks", [1, 2, 4])
def test_the_whole_process_peak_on_one_cpu_is_predicted_within_ten_percent(chunks) -> None:
    # Measured: every storage the step creates, parameters added (the harness's figure plus them).
    torch.manual_seed(0)
    seq = gpt_layers(vocab_size=256, d_model=64, n_heads=4, n_layers=4, seq_len=32, dropout=0.1)
    x, y = torch.randint(256, (4, 32)), torch.randint(256, (4, 32))

    def loss(out, target):
        return F.cross_entropy(out.flatten(0, 1), target.flatten())

    fitted = profile(seq, split_batch(x, chunks), loss_fn=loss, target=split_batch(y, chunks), rounds=1)
    params = sum(p.numel() * p.element_size() for p in seq.parameters())
    off = {}
    for modes in (
        ["never"] * 4,
        ["always"] * 4,
        ["always:1"] * 4,
        ["always", "always:1", "never", "selective"],
    ):
        stage_plan = plan(seq, devices=[CPU], balance=[2, 2, 2, 1], checkpoint=modes, chunks=chunks)
        engine = LocalPipeline(seq, stage_plan, chunks=chunks, pin_memory=False)
        seq.zero_grad(set_to_none=True)
        tracker = StageTracker(1)  # one "stage": the whole process
        tracker.exclude([*seq.parameters(), x, y])
        torch.manual_seed(0)
        with tracker:
            loss(engine.forward(x), y).backward()
        seq.zero_grad(set_to_none=True)
        predicted = process_peak(fitted, stage_plan, chunks=chunks, optimizer="sgd")
        off["/".join(modes)] = predicted / (tracker.total_peak + params)
    assert all(0.9 <= r <= 1.1 for r in off.values()), off
