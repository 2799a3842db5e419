"""benchmarks/secagg_cost.py's own logic: the model it sizes, the run it configures, the bytes per organization
and kind it reads off the rounds' records, and its check of those records against the Prometheus counters."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetfed.aggregator.config import aggregator_config_from_mapping
from hetfed.wire.messages import RoundSummary, TrafficCount
from tests.conftest import load_benchmark

bench = load_benchmark("secagg_cost")


def test_the_model_has_the_declared_parameter_count() -> None:
    assert bench.latent_for(1_000_000) == 1258 and bench.mlp1_params(1258) == 1_000_120
    assert bench.latent_for(10_000_000) == 12579 and bench.mlp1_params(12579) == 10_000_315
    from hetfed.client.models import build_model, count_parameters

    model = build_model("mlp1", (1, 28, 28), 10, latent_dim=13)
    assert count_parameters(model) == bench.mlp1_params(13) == 784 * 13 + 13 + 130 + 10


@pytest.mark.parametrize("secure", [False, True])
def test_the_run_is_fedavg_over_everyone_with_or_without_secure_aggregation(secure: bool, tmp_path: Path) -> None:
    cfg = aggregator_config_from_mapping(bench.aggregator_config(3, 4, secure, tmp_path, 7))
    (run,) = cfg.runs
    assert (run.algorithm, run.organizations, run.rounds, run.seed) == ("fedavg", ("org-0", "org-1", "org-2"), 4, 7)
    assert run.secure_aggregation is secure


def _round(r: int, masked: int, advert: int) -> RoundSummary:
    return RoundSummary(r, 2, 1.0, (TrafficCount("up", "secagg_masked_input", masked, 2, 0),
                                    TrafficCount("up", "secagg_key_advert", advert, 2, 0),
                                    TrafficCount("down", "model_weights", 800, 2, 0)))


HISTORY = [_round(1, 10_000, 50), _round(2, 1_600, 184), _round(3, 1_700, 200), _round(4, 1_604, 190),
           RoundSummary(5, 2, 0.1, (TrafficCount("down", "model_weights", 999_999, 2, 0),))]


def test_bytes_per_organization_are_the_median_of_rounds_2_to_r_over_n() -> None:
    kinds = bench.per_round_kinds(HISTORY, 4, 2)
    # rounds 2..4 only: round 1 (set-up) and the evaluate round 5 left out; medians 1604 and 190, over N = 2
    assert kinds == {"up": {"secagg_key_advert": 95.0, "secagg_masked_input": 802.0},
                     "down": {"model_weights": 400.0}}


def test_the_prometheus_counters_must_hold_every_rounds_record() -> None:
    total = {("up", "secagg_masked_input"): 14_904, ("up", "secagg_key_advert"): 624,
             ("down", "model_weights"): 1_003_199}
    # split between two organizations, plus a Join's bytes the rounds' records do not hold
    counters = {(org, d, k): v / 2 for (d, k), v in total.items() for org in ("org-0", "org-1")}
    counters[("org-0", "up", "envelope")] = 40.0
    seen = bench.prometheus_figures(counters, HISTORY, 2)
    assert seen["prometheus_covers_rounds"] and seen["prometheus_organizations"]
    assert seen["prometheus_up_per_org"] == {"org-0": 7_764.0 + 40.0, "org-1": 7_764.0}
    counters[("org-1", "up", "secagg_key_advert")] -= 1  # one byte fewer than the rounds recorded
    assert not bench.prometheus_figures(counters, HISTORY, 2)["prometheus_covers_rounds"]
    assert not bench.prometheus_figures(counters, HISTORY, 3)["prometheus_organizations"]


def test_a_row_shows_the_masked_input_and_the_stages_apart() -> None:
    row = {"system": "hetfed", "arm": "secure", "params": 1_000_120, "clients": 4, "round_s": 1.234,
           "up_per_org": 8_101_234, "masked_up": 8_000_000, "stages_up": 1_234, "stages_down": 2_060,
           "down_per_org": 4_200_000, "agg_cpu_s": 0.5, "clients_cpu_s": 1.25, "agg_peak_rss_mb": 300.2,
           "load_before": 1.0, "load_after": 2.0}
    assert bench.report(row) == ("| hetfed secure | 1,000,120 | 4 | 1.23 | 8.10 | 8.00 | 1.2 / 2.1 | 4.20 | 0.50 | "
                                 "1.25 | 300 | 1-2 |")
