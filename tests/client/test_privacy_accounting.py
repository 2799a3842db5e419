"""Privacy accounting: ε of DP-SGD against Opacus' RDP accountant on documented settings, PLD against RDP,
composition against dp-accounting's own events, σ solved for a target ε, and the ledger kept on disk."""

from __future__ import annotations

import json
import math
from pathlib import Path

import dp_accounting
import pytest
from dp_accounting import pld, rdp

from hetfed.client.privacy.ledger import (
    FILE_NAME,
    Ledger,
    LedgerError,
    Release,
    epsilon_of,
    merged,
    solve_noise_multiplier,
)

# Abadi et al. 2016's MNIST setting (lot 256 of 60,000, σ = 1.1, 60 epochs of 235 steps, δ = 1e-5) and a short
# high-rate run.
MNIST = (256 / 60000, 1.1, 60 * 235, 1e-5)
SHORT = (0.064, 1.0, 16, 1e-5)


def opacus_rdp(q: float, sigma: float, steps: int, delta: float) -> float:
    from opacus.accountants import RDPAccountant

    acc = RDPAccountant()
    acc.history = [(sigma, q, steps)]
    return float(acc.get_epsilon(delta))


@pytest.mark.parametrize("setting", [MNIST, SHORT], ids=["abadi-mnist", "q0.064-16steps"])
def test_rdp_epsilon_matches_opacus_and_pld_is_tighter(setting: tuple[float, float, int, float]) -> None:
    q, sigma, steps, delta = setting
    eps = epsilon_of([Release(q, sigma, steps)], delta, "rdp")
    theirs = opacus_rdp(q, sigma, steps, delta)
    assert eps == pytest.approx(theirs, rel=1e-3)
    assert f"{eps:.3g}" == f"{theirs:.3g}"  # 3 significant digits
    tight = epsilon_of([Release(q, sigma, steps)], delta, "pld")
    assert 0.5 * eps < tight <= eps * 1.001


def test_mnist_setting_value() -> None:
    """The number itself (dp-accounting RDP, add-or-remove-one): ε ≈ 2.60 for Abadi et al.'s MNIST run."""
    assert epsilon_of([Release(*MNIST[:3])], MNIST[3]) == pytest.approx(2.6003, abs=5e-4)


def composed(events: list[dp_accounting.DpEvent], delta: float, accountant: str) -> float:
    acc: dp_accounting.PrivacyAccountant = rdp.RdpAccountant() if accountant == "rdp" else pld.PLDAccountant()
    acc.compose(dp_accounting.ComposedDpEvent(events))
    return float(acc.get_epsilon(delta))


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_composition_is_dp_accountings_composed_event(accountant: str) -> None:
    """A DP-SGD run and a Gaussian release on the whole set (a class-sum release, σ/√2): exactly dp-accounting's ε
    of the ComposedDpEvent of those events built by hand."""
    q, sigma, steps, delta = 0.02, 1.3, 50, 1e-5
    ours = epsilon_of([Release(q, sigma, steps), Release(1.0, sigma / math.sqrt(2))], delta, accountant)
    theirs = composed([dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps),
        dp_accounting.GaussianDpEvent(sigma / math.sqrt(2))], delta, accountant)
    assert ours == theirs
    # Composition costs: more than either part alone.
    assert ours > epsilon_of([Release(q, sigma, steps)], delta, accountant)
    assert ours > epsilon_of([Release(1.0, sigma / math.sqrt(2))], delta, accountant)


def test_release_events_are_the_documented_dp_events() -> None:
    assert Release(1.0, 2.0).event() == dp_accounting.GaussianDpEvent(2.0)
    assert Release(0.1, 2.0).event() == dp_accounting.PoissonSampledDpEvent(0.1, dp_accounting.GaussianDpEvent(2.0))
    assert Release(0.1, 2.0, 7).event() == dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(0.1, dp_accounting.GaussianDpEvent(2.0)), 7)


def test_merged_joins_equal_events_in_first_appearance_order() -> None:
    a, b = (0.01, 1.0), (1.0, 0.7)
    out = merged([Release(*a, 2), Release(*b), Release(*a, 3), Release(0.5, 0.5, 0), Release(*b, 4)])
    assert out == [Release(*a, 5), Release(*b, 5)]
    assert merged([Release(*b, 5), Release(*a, 5)]) == [Release(*b, 5), Release(*a, 5)]
    assert merged([]) == [] and merged([Release(*a, 0)]) == []
    # ε depends on the multiset of events only: split, interleaved or reordered runs all compose the same.
    one = epsilon_of([Release(*a, 5), Release(*b, 5)], 1e-5)
    assert epsilon_of([Release(*b, 2), Release(*a, 1), Release(*b, 3), Release(*a, 4)], 1e-5) == pytest.approx(one,
                                                                                                                rel=1e-12)
    assert epsilon_of([Release(*b, 5), Release(*a, 5)], 1e-5) == pytest.approx(one, rel=1e-12)


def test_nothing_released_spends_nothing() -> None:
    assert epsilon_of([], 1e-5) == 0.0
    assert epsilon_of([Release(0.1, 1.0, 0)], 1e-5, "pld") == 0.0


# ---------------------------------------------------------------------------------------------- solving σ
def test_solved_sigma_spends_at_most_the_target_and_one_percent_less_spends_more() -> None:
    plan, target, delta = [Release(0.05, 1.0, 200)], 3.0, 1e-6
    sigma = solve_noise_multiplier(plan, target, delta)
    assert epsilon_of([Release(0.05, sigma, 200)], delta) <= target
    assert epsilon_of([Release(0.05, sigma * 0.99, 200)], delta) > target
    assert 0.5 < sigma < 5


def test_solved_sigma_counts_each_releases_multiple_of_sigma() -> None:
    """A plan whose releases carry σ/√2 (two objectives per sample): the solved σ spends ≤ target with that
    multiple applied, and the multiple is honoured (0.99σ overspends)."""
    plan, target, delta = [Release(0.1, 1 / math.sqrt(2), 30), Release(1.0, 1 / math.sqrt(2))], 2.0, 1e-5
    sigma = solve_noise_multiplier(plan, target, delta)
    spend = lambda s: epsilon_of([Release(r.q, r.sigma * s, r.count) for r in plan], delta)  # noqa: E731
    assert spend(sigma) <= target < spend(0.99 * sigma)


def test_impossible_target_is_a_clear_value_error() -> None:
    with pytest.raises(ValueError, match=r"no noise multiplier up to 10\^4 reaches ε=0.0001 at δ=1e-05"):
        solve_noise_multiplier([Release(1.0, 1.0, 10**5)], 1e-4, 1e-5)
    with pytest.raises(ValueError, match="nothing to account"):
        solve_noise_multiplier([Release(0.1, 1.0, 0)], 1.0, 1e-5)


def test_a_target_met_by_tiny_noise_gives_the_floor_of_0_05() -> None:
    assert solve_noise_multiplier([Release(0.001, 1.0, 1)], 1e3, 1e-5) == 0.05


# ---------------------------------------------------------------------------------------------- the ledger
def open_ledger(state: Path | None, **over: object) -> Ledger:
    kw: dict = {"delta": 1e-5, "accountant": "rdp", "noise_multiplier": 1.1, "clip_norm": 0.8, **over}  # type: ignore[type-arg]
    return Ledger.open(str(state) if state is not None else None, "run-a", "org-1", **kw)


def test_ledger_is_continued_from_disk_with_its_sigma_and_releases(tmp_path: Path) -> None:
    led = open_ledger(tmp_path)
    led.record(0.01, 1.1, 10)
    led.record(0.01, 1.1, 5)
    led.record(1.0, 1.1 / math.sqrt(2))
    assert led.pending == [Release(0.01, 1.1, 15), Release(1.0, 1.1 / math.sqrt(2))]
    assert led.releases == [] and led.epsilon() == 0.0  # pending releases are not spent until the round closes
    eps = led.close_round(1)
    assert led.pending == [] and eps == epsilon_of([Release(0.01, 1.1, 15), Release(1.0, 1.1 / math.sqrt(2))], 1e-5)
    path = tmp_path / "run-a" / FILE_NAME
    assert json.loads(path.read_text())["epsilon"] == eps
    assert sorted(p.name for p in path.parent.iterdir()) == [FILE_NAME]  # written atomically: no .tmp left
    # A new process opens it with no σ of its own (it would solve one) and another C: the kept ones win.
    again = open_ledger(tmp_path, noise_multiplier=0.0, clip_norm=5.0)
    assert again.noise_multiplier == 1.1 and again.clip_norm == 0.8
    assert again.releases == led.releases and again.rounds == {1: eps} and again.epsilon() == eps
    # What a next round would cost is asked without spending it.
    extra = [Release(0.01, 1.1, 10)]
    assert again.epsilon(extra) == epsilon_of([*led.releases, *extra], 1e-5) > eps
    assert again.epsilon() == eps


def test_epsilon_never_goes_down_across_rounds_and_restarts(tmp_path: Path) -> None:
    led = open_ledger(tmp_path)
    seen = []
    for round_ in range(1, 5):
        if round_ != 3:  # round 3 releases nothing: ε stays
            led.record(0.02, 1.1, 20)
        seen.append(led.close_round(round_))
    assert seen[0] < seen[1] == seen[2] < seen[3]
    # Restarted in round 4: the redone round's releases add to the first attempt's, its ε kept at the larger.
    again = open_ledger(tmp_path)
    again.record(0.02, 1.1, 20)
    redone = again.close_round(4)
    assert redone > seen[3] and again.rounds[4] == redone
    assert again.releases == [Release(0.02, 1.1, 80)]
    assert list(again.rounds.values()) == sorted(again.rounds.values())
    assert json.loads((tmp_path / "run-a" / FILE_NAME).read_text())["rounds"] == {
        "1": seen[0], "2": seen[1], "3": seen[2], "4": redone}


@pytest.mark.parametrize(("field", "over"), [("delta", {"delta": 1e-6}), ("accountant", {"accountant": "pld"})])
def test_a_ledger_kept_under_other_settings_is_refused_naming_the_field(tmp_path: Path, field: str,
                                                                        over: dict) -> None:  # type: ignore[type-arg]
    led = open_ledger(tmp_path)
    led.record(0.01, 1.1, 3)
    led.close_round(1)
    with pytest.raises(LedgerError, match=rf"other settings: {field} "):
        open_ledger(tmp_path, **over)


def test_a_ledger_of_another_organization_is_refused(tmp_path: Path) -> None:
    open_ledger(tmp_path).close_round(1)
    with pytest.raises(LedgerError, match="organization 'org-1' \\(now 'org-2'\\)"):
        Ledger.open(str(tmp_path), "run-a", "org-2", delta=1e-5, accountant="rdp", noise_multiplier=1.0, clip_norm=1.0)
    # Another run is another file: a fresh ledger.
    other = Ledger.open(str(tmp_path), "run-b", "org-1", delta=1e-5, accountant="rdp", noise_multiplier=1.0,
                        clip_norm=1.0)
    assert other.releases == [] and other.noise_multiplier == 1.0


@pytest.mark.parametrize("body", ['{"format": 1, "identity": {"run"', "", "\x00\x01"])
def test_a_corrupted_ledger_is_a_ledger_error(tmp_path: Path, body: str) -> None:
    path = tmp_path / "run-a" / FILE_NAME
    path.parent.mkdir()
    path.write_text(body)
    with pytest.raises(LedgerError, match="cannot be read"):
        open_ledger(tmp_path)


def test_a_ledger_of_another_format_is_a_ledger_error(tmp_path: Path) -> None:
    led = open_ledger(tmp_path)
    led.close_round(1)
    path = tmp_path / "run-a" / FILE_NAME
    raw = json.loads(path.read_text())
    path.write_text(json.dumps({**raw, "format": 4}))
    with pytest.raises(LedgerError, match=r"is not a hetfed privacy ledger of format 3$"):
        open_ledger(tmp_path)


def test_released_values_are_written_with_the_releases_that_paid_for_them(tmp_path: Path) -> None:
    """``hold`` keeps a value pending with the round's releases: neither is on disk before the commit, both are
    after it, in one write; a reopened ledger has them, and the round it first joined at."""
    led = open_ledger(tmp_path)
    led.record(1.0, 10.0)
    led.hold("class_counts", [5, 0, 7])
    path = tmp_path / "run-a" / FILE_NAME
    assert not path.exists() and led.released == {}
    led.joined_at = 0
    eps = led.close_round(0)
    on_disk = json.loads(path.read_text())
    assert on_disk["released"] == {"class_counts": [5, 0, 7]} and on_disk["releases"] == [[1.0, 10.0, 1]]
    assert on_disk["epsilon"] == eps and on_disk["joined_at"] == 0
    again = open_ledger(tmp_path)
    assert again.loaded and again.released == {"class_counts": [5, 0, 7]} and again.joined_at == 0
    assert again.epsilon() == eps


@pytest.mark.parametrize("body", ["[]", "null", "MISSING"])
def test_valid_json_of_another_shape_is_a_ledger_error(tmp_path: Path, body: str) -> None:
    led = open_ledger(tmp_path)
    led.close_round(1)
    path = tmp_path / "run-a" / FILE_NAME
    if body == "MISSING":  # the right identity, the fields gone
        body = json.dumps({"format": 1, "identity": json.loads(path.read_text())["identity"]})
    path.write_text(body)
    with pytest.raises(LedgerError):
        open_ledger(tmp_path)


def test_a_ledger_without_state_dir_lives_in_memory(tmp_path: Path) -> None:
    led = open_ledger(None)
    led.record(0.01, 1.1, 4)
    assert led.path is None and led.close_round(1) > 0
    assert led.rounds == {1: led.epsilon()}
