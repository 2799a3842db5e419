"""An organization's ``[privacy]`` settings (ranges, exclusions, what they switch on, δ = 1/N̂²) and its privacy
session: the example count N̂ released once, σ planned (with N̂'s release) or kept, the budget checked before each
round, a ledger that starts past round 1 refused, the declaration, the round's generator."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from hetfed.client.privacy.config import PrivacyConfig
from hetfed.client.privacy.ledger import FILE_NAME, LedgerError, Release, epsilon_of
from hetfed.client.privacy.session import PrivacySession
from hetfed.wire.config import ConfigError, from_mapping
from hetfed.wire.privacy import PrivacyDeclaration

CPU = torch.device("cpu")


# ---------------------------------------------------------------------------------------------- PrivacyConfig
@pytest.mark.parametrize("field", ["epsilon_budget", "target_epsilon", "noise_multiplier", "delta", "clip_norm",
                                   "count_noise_multiplier"])
@pytest.mark.parametrize("value", [0.0, -1.0, math.nan, math.inf])
def test_non_positive_or_non_finite_values_are_refused_naming_the_field(field: str, value: float) -> None:
    with pytest.raises(ConfigError, match=rf"{field} must be a number > 0"):
        PrivacyConfig(**{field: value})  # type: ignore[arg-type]


def test_config_errors_are_value_errors() -> None:
    assert issubclass(ConfigError, ValueError)


def test_delta_must_be_below_one() -> None:
    with pytest.raises(ConfigError, match=r"delta must be < 1, got 1\.0"):
        PrivacyConfig(noise_multiplier=1.0, delta=1.0)
    assert PrivacyConfig(noise_multiplier=1.0, delta=0.5).delta == 0.5


def test_noise_multiplier_and_target_exclude_each_other() -> None:
    with pytest.raises(ConfigError, match=r"noise_multiplier and target_epsilon exclude each other"):
        PrivacyConfig(noise_multiplier=1.0, target_epsilon=2.0)
    # σ with a budget is allowed: the budget stops the run, σ is not solved.
    assert PrivacyConfig(noise_multiplier=1.0, epsilon_budget=2.0).solve_for is None


def test_target_above_budget_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"target_epsilon \(5\.0\) exceeds epsilon_budget \(4\.0\)"):
        PrivacyConfig(epsilon_budget=4.0, target_epsilon=5.0)
    assert PrivacyConfig(epsilon_budget=4.0, target_epsilon=4.0).solve_for == 4.0


def test_noise_seed_below_minus_one_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"noise_seed must be >= 0, or -1"):
        PrivacyConfig(noise_multiplier=1.0, noise_seed=-2)


def test_enabled_and_solve_for() -> None:
    assert not PrivacyConfig().enabled
    assert not PrivacyConfig(clip_norm=2.0, delta=1e-5, accountant="pld").enabled  # settings alone switch nothing
    assert PrivacyConfig(epsilon_budget=3.0).enabled and PrivacyConfig(epsilon_budget=3.0).solve_for == 3.0
    assert PrivacyConfig(target_epsilon=2.0).enabled and PrivacyConfig(target_epsilon=2.0).solve_for == 2.0
    assert PrivacyConfig(target_epsilon=2.0, epsilon_budget=3.0).solve_for == 2.0
    assert PrivacyConfig(noise_multiplier=0.9).enabled and PrivacyConfig(noise_multiplier=0.9).solve_for is None
    assert PrivacyConfig().solve_for is None


def test_delta_is_one_over_n_squared_unless_set() -> None:
    cfg = PrivacyConfig(epsilon_budget=1.0)
    assert cfg.delta_for(1000) == 1e-6
    assert cfg.delta_for(60000) == 1.0 / 3_600_000_000
    assert cfg.delta_for(3) == 1.0 / 9
    assert cfg.delta_for(1) == cfg.delta_for(0) == 0.25  # N floored at 2: δ stays < 1
    assert PrivacyConfig(epsilon_budget=1.0, delta=1e-5).delta_for(1000) == 1e-5


def test_the_privacy_table_is_type_checked() -> None:
    """``[privacy]`` read from a mapping: accountant and batchnorm choices and field names are checked too."""
    ok = from_mapping(PrivacyConfig, {"epsilon_budget": 8, "accountant": "pld", "batchnorm": "refuse"}, "privacy")
    assert ok == PrivacyConfig(epsilon_budget=8.0, accountant="pld", batchnorm="refuse")
    with pytest.raises(ConfigError, match=r"privacy\.accountant: must be one of 'rdp', 'pld', got 'gdp'"):
        from_mapping(PrivacyConfig, {"accountant": "gdp"}, "privacy")
    with pytest.raises(ConfigError, match=r"privacy\.batchnorm: must be one of"):
        from_mapping(PrivacyConfig, {"batchnorm": "keep"}, "privacy")
    with pytest.raises(ConfigError, match="did you mean 'noise_multiplier'"):
        from_mapping(PrivacyConfig, {"noise_multipler": 1.0}, "privacy")
    with pytest.raises(ConfigError, match=r"clip_norm must be a number > 0"):
        from_mapping(PrivacyConfig, {"clip_norm": -1}, "privacy")


def test_the_budget_defaults_to_the_target() -> None:
    assert PrivacyConfig(target_epsilon=2.0).budget == 2.0
    assert PrivacyConfig(target_epsilon=2.0, epsilon_budget=3.0).budget == 3.0
    assert PrivacyConfig(epsilon_budget=3.0).budget == 3.0
    assert PrivacyConfig(noise_multiplier=1.0).budget is None


def test_privacy_without_state_dir_is_refused_unless_the_ledger_is_declared_ephemeral() -> None:
    from hetfed.client.config import ClientConfig

    with pytest.raises(ConfigError, match=r"^\[privacy\] needs state_dir: the privacy ledger is kept there, and "
                                          r"without it a restarted client would count ε from zero; set state_dir "
                                          r"\(or privacy.ephemeral_ledger = true for an experiment\)$"):
        ClientConfig(organization="o", run="r", privacy=PrivacyConfig(epsilon_budget=1.0))
    ClientConfig(organization="o", run="r", privacy=PrivacyConfig(epsilon_budget=1.0, ephemeral_ledger=True))
    ClientConfig(organization="o", run="r", privacy=PrivacyConfig(epsilon_budget=1.0), state_dir="s")
    ClientConfig(organization="o", run="r")  # no DP, no ledger


# ---------------------------------------------------------------------------------------------- PrivacySession
N, B, ROUNDS, STEPS = 1000, 50, 10, 20
COUNT = Release(1.0, 20.0)  # the example count's release at the default count_noise_multiplier


def session(cfg: PrivacyConfig, state: Path | None = None) -> PrivacySession:
    s = PrivacySession(cfg, "run", "org", str(state) if state else None, N, CPU)
    s.release_examples()
    s.set_batch_size(B)
    return s


def plan(s: PrivacySession, rounds: int = ROUNDS) -> float:
    return s.plan("dp-sgd", [Release(1.0, 1 / math.sqrt(2))], [Release(s.q, 1.0, STEPS)], rounds)


def run_round(s: PrivacySession, round_: int) -> PrivacyDeclaration:
    s.ledger.record(s.q, s.sigma, STEPS)
    return s.close_round(round_)


def test_budget_lets_the_planned_rounds_through_and_stops_the_next() -> None:
    """σ solved so that the setup release and 10 rounds of 20 steps spend the budget: the setup and every one of
    the 10 rounds fit; the 11th would exceed it, and is refused with a message saying so."""
    s = session(PrivacyConfig(epsilon_budget=2.0))
    n, q, delta = s.num_examples, B / s.num_examples, 1.0 / s.num_examples**2
    assert s.q == q and s.delta == delta and s.sigma == 0.0
    sigma = plan(s)
    assert sigma > 0 and s.sigma == sigma
    total = epsilon_of([COUNT, Release(1.0, sigma / math.sqrt(2)), Release(q, sigma, STEPS * ROUNDS)], delta)
    assert total <= 2.0 and s.planned_epsilon == pytest.approx(total, rel=1e-12) and n > 0
    assert s.exhausted_before(setup=True) is None
    s.ledger.record(1.0, sigma / math.sqrt(2))
    s.close_round(0)
    declared = []
    for r in range(1, ROUNDS + 1):
        assert s.exhausted_before(setup=False) is None, r
        declared.append(run_round(s, r).epsilon)
    assert declared == sorted(declared) and declared[-1] == pytest.approx(total, rel=1e-12) and s.spent() <= 2.0
    why = s.exhausted_before(setup=False)
    assert why is not None
    assert why.startswith(f"org: privacy budget ε=2 at δ={delta:.3g} would be exceeded by the next round")
    assert f"ε {s.spent():.4g} spent" in why and "leaves the run" in why


def test_no_budget_never_stops() -> None:
    s = session(PrivacyConfig(noise_multiplier=0.5))
    assert plan(s) == 0.5
    s.ledger.record(1.0, 0.01, 100)  # an enormous ε
    s.close_round(1)
    assert s.spent() > 100 and s.exhausted_before(setup=False) is None


def test_given_sigma_is_used_and_the_budget_still_checked() -> None:
    s = session(PrivacyConfig(noise_multiplier=0.8, epsilon_budget=1.0))
    assert plan(s) == 0.8
    assert s.scaled([Release(0.05, 0.5, 3)]) == [Release(0.05, 0.4, 3)]
    while s.exhausted_before(setup=False) is None:
        run_round(s, 1)
    assert s.spent() <= 1.0 < s.ledger.epsilon(s.scaled([Release(s.q, 1.0, STEPS)]))


def test_declaration_and_figures() -> None:
    s = session(PrivacyConfig(noise_multiplier=1.2, clip_norm=0.5, accountant="rdp", delta=1e-6,
                              ephemeral_ledger=True))
    plan(s)
    d = run_round(s, 1)
    assert d == PrivacyDeclaration(mechanism="dp-sgd", noise_multiplier=1.2, clip_norm=0.5,
                                   epsilon=epsilon_of([COUNT, Release(s.q, 1.2, STEPS)], 1e-6), delta=1e-6,
                                   accountant="rdp", ephemeral_ledger=True)
    assert d.check() is d
    assert s.figures(d) == {"privacy_epsilon": d.epsilon, "privacy_delta": 1e-6, "privacy_noise_multiplier": 1.2,
                            "privacy_clip_norm": 0.5}


def test_a_ledger_on_disk_is_declared_not_ephemeral(tmp_path: Path) -> None:
    s = session(PrivacyConfig(noise_multiplier=1.2), tmp_path)
    plan(s)
    assert not run_round(s, 1).ephemeral_ledger


def test_a_restarted_session_keeps_the_sigma_it_planned_with(tmp_path: Path) -> None:
    cfg = PrivacyConfig(epsilon_budget=3.0, noise_seed=7)
    first = session(cfg, tmp_path)
    sigma = plan(first)
    run_round(first, 1)
    again = session(cfg, tmp_path)
    assert again.sigma == sigma
    assert plan(again, rounds=40) == sigma  # not solved again for another plan: the ledger's σ wins
    assert again.spent() == first.spent() > 0


def test_round_generators_repeat_from_the_seed_and_differ_for_a_redone_round() -> None:
    s = session(PrivacyConfig(noise_multiplier=1.0, noise_seed=3))
    plan(s)

    def draw(round_: int, seed: int) -> torch.Tensor:
        return torch.rand(6, generator=s.generator(round_, seed))

    assert torch.equal(draw(1, 11), draw(1, 11))
    assert not torch.equal(draw(1, 11), draw(2, 11)) and not torch.equal(draw(1, 11), draw(1, 12))
    before = draw(1, 11)
    run_round(s, 1)  # the ledger now holds releases: a redone round 1 draws other noise
    assert not torch.equal(before, draw(1, 11))
    step = s.step_for(2, 11)
    assert (step.sigma, step.clip_norm, step.q) == (1.0, 1.0, B / s.num_examples)
    assert step.expected_batch == pytest.approx(B, rel=1e-15)  # q·N̂ = B, whatever N is
    assert step.ledger is s.ledger


def test_a_client_without_dp_imports_neither_opacus_nor_dp_accounting() -> None:
    """The DP libraries cost over a second of start-up: only a client under [privacy] imports them."""
    import subprocess
    import sys

    script = ("import sys\nimport torch\nfrom hetfed.client.config import ClientConfig\n"
              "from hetfed.client.runtime import ClientRuntime\nfrom hetfed.client.algorithms import "
              "client_half_type\nfrom hetfed.wire.specs import SPECS\nfor spec in SPECS.values():\n"
              "    client_half_type(spec)\nruntime = ClientRuntime(ClientConfig(organization='o', run='r'))\n"
              "assert runtime._privacy_session(None, torch.device('cpu')) is None\n"
              "print(sorted(m for m in ('opacus', 'dp_accounting') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


# ---------------------------------------------------------------------------------------------- example counts
def test_the_example_count_is_released_once_and_read_back_after_a_restart(tmp_path: Path) -> None:
    """N̂ = max(1, round(N + N(0, 20²))) from the secret generator, its Gaussian release (sensitivity 1, σ_N = 20)
    in the ledger with the value, on disk before anything leaves; a restart reads N̂ back and releases nothing."""
    from hetfed.client.privacy.mechanisms import secret_generator

    cfg = PrivacyConfig(noise_multiplier=1.0, noise_seed=5)
    first = PrivacySession(cfg, "run", "org", str(tmp_path), N, CPU)
    assert first.release_examples() == 1007  # N = 1000 and this seed's draw
    noise = torch.normal(0.0, 20.0, size=(1,), generator=secret_generator(5, ["example-count", "org"], CPU),
                         dtype=torch.float64)
    assert first.num_examples == max(1, round(N + float(noise[0])))
    assert first.ledger.releases == [COUNT] and first.ledger.released == {"examples": 1007}
    on_disk = json.loads((tmp_path / "run" / FILE_NAME).read_text())
    assert on_disk["released"] == {"examples": 1007} and on_disk["releases"] == [[1.0, 20.0, 1]]
    assert on_disk["epsilon"] == epsilon_of([COUNT], 1.0 / 1007**2) and on_disk["format"] == 3
    # Everything declared derives from N̂: δ = 1/N̂², q = B/N̂, qN̂ = B, the steps of a round over N̂.
    first.set_batch_size(B)
    assert first.delta == 1.0 / 1007**2 and first.q == 50 / 1007
    again = PrivacySession(PrivacyConfig(noise_multiplier=1.0, noise_seed=6), "run", "org", str(tmp_path), N, CPU)
    assert again.release_examples() == 1007  # another seed, the same N̂: nothing is drawn again
    assert again.ledger.releases == [COUNT] and again.spent() == first.spent()


def test_the_count_needs_no_seed_to_be_released_once_per_run(tmp_path: Path) -> None:
    """With OS entropy (noise_seed -1) two fresh ledgers draw their own N̂; a restart keeps the first."""
    cfg = PrivacyConfig(noise_multiplier=1.0)
    one = PrivacySession(cfg, "run", "org", str(tmp_path), N, CPU).release_examples()
    assert PrivacySession(cfg, "run", "org", str(tmp_path), N, CPU).release_examples() == one


def test_the_plan_includes_the_count_release_as_dp_accounting_composes_it() -> None:
    """σ is solved with N̂'s release in the composition: ε of the plan is dp-accounting's ε of the count's
    Gaussian (σ_N = 20), the setup release and every planned step, to 1e-9, within the target; and σ is larger than
    it would be without the count."""
    import dp_accounting
    from dp_accounting import rdp

    from hetfed.client.privacy.ledger import solve_noise_multiplier

    s = session(PrivacyConfig(target_epsilon=2.0, noise_seed=5))
    sigma = plan(s)
    acc = rdp.RdpAccountant()
    acc.compose(dp_accounting.ComposedDpEvent([
        dp_accounting.GaussianDpEvent(20.0),
        dp_accounting.GaussianDpEvent(sigma / math.sqrt(2)),
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(50 / 1007, dp_accounting.GaussianDpEvent(sigma)), STEPS * ROUNDS),
    ]))
    expected = acc.get_epsilon(1.0 / 1007**2)
    assert s.planned_epsilon is not None and abs(s.planned_epsilon - expected) < 1e-9
    assert expected <= 2.0
    without = solve_noise_multiplier([Release(1.0, 1 / math.sqrt(2)), Release(50 / 1007, 1.0, STEPS * ROUNDS)], 2.0,
                                      1.0 / 1007**2)
    assert sigma > without


def test_a_count_release_that_alone_spends_the_target_is_refused() -> None:
    s = session(PrivacyConfig(target_epsilon=0.1, noise_seed=5))
    with pytest.raises(ValueError, match=r"the releases made before the run's plan \(the example count\) already "
                                         r"spend ε=0\.2\d* of the target ε=0\.1"):
        plan(s)


def test_a_target_alone_is_enforced_as_the_budget() -> None:
    """Only target_epsilon: σ is solved for it, the planned rounds fit, the next one is refused."""
    s = session(PrivacyConfig(target_epsilon=2.0, noise_seed=5))
    plan(s)
    s.ledger.record(1.0, s.sigma / math.sqrt(2))
    s.close_round(0)
    for r in range(1, ROUNDS + 1):
        assert s.exhausted_before(setup=False) is None, r
        run_round(s, r)
    assert s.spent() <= 2.0
    why = s.exhausted_before(setup=False)
    assert why is not None and why.startswith("org: privacy budget ε=2 at")


# ---------------------------------------------------------------------------------------------- late ledgers
def test_a_ledger_that_first_joins_past_round_1_is_refused_and_stays_refused(tmp_path: Path) -> None:
    s = session(PrivacyConfig(noise_multiplier=1.0), tmp_path)
    with pytest.raises(LedgerError) as err:
        s.joined(3)
    assert str(err.value) == (
        f"org: privacy: run 'run' was at round 3 when this organization's privacy ledger ({tmp_path / 'run' / FILE_NAME})"
        " first joined it: the ledger was lost, or the organization joins late for the first time, and hetfed "
        "cannot tell these apart; ε cannot be continued, so it sends nothing (restore the ledger, or start a new run)")
    # Kept in the ledger: a restart, whatever round the run is at, is refused the same way.
    with pytest.raises(LedgerError, match="was at round 3 when"):
        session(PrivacyConfig(noise_multiplier=1.0), tmp_path).joined(4)


@pytest.mark.parametrize("first", [0, 1])
def test_a_ledger_that_joined_at_the_start_goes_on_in_any_later_round(tmp_path: Path, first: int) -> None:
    s = session(PrivacyConfig(noise_multiplier=1.0), tmp_path)
    s.joined(first)
    again = session(PrivacyConfig(noise_multiplier=1.0), tmp_path)
    again.joined(7)  # a restart: its ledger joined at the start
    assert again.ledger.joined_at == first


def test_a_format_1_ledger_is_refused_in_one_clean_line(tmp_path: Path) -> None:
    path = tmp_path / "run" / FILE_NAME
    path.parent.mkdir()
    path.write_text(json.dumps({"format": 1, "identity": {"run": "run", "organization": "org", "delta": 1e-6,
                                                          "accountant": "rdp"},
                                "noise_multiplier": 1.0, "clip_norm": 1.0, "epsilon": 0.5, "releases": [],
                                "rounds": {}}))
    with pytest.raises(LedgerError, match=r"is a privacy ledger of format 1, which kept no released values, so a "
                                          r"restart could not send the same ones again; finish this run with the "
                                          r"hetfed version that wrote it, or start a new run$"):
        PrivacySession(PrivacyConfig(noise_multiplier=1.0), "run", "org", str(tmp_path), N, CPU)
