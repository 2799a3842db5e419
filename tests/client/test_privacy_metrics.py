"""Evaluation figures under DP: the sums an evaluation is released from, the Gaussian set release (exact under a
seeded generator), its ledger entry and sensitivity, the gate that withholds what has no mechanism, the σ plan
that includes the metric releases, and the card of a model trained outside DP."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from hetfed.client.privacy.config import PrivacyConfig
from hetfed.client.privacy.ledger import Release, epsilon_of
from hetfed.client.privacy.metrics import (
    SetSums,
    evaluation_sums,
    gate,
    release_set,
    released_figures,
    set_release,
)
from hetfed.client.privacy.session import PrivacySession
from hetfed.client.training import DeviceData
from hetfed.wire.config import ConfigError
from hetfed.wire.payloads import EvalMetrics

CPU = torch.device("cpu")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


class _Fixed(nn.Module):
    """Returns the logits stored for each input index (the input is that index)."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.logits = nn.Parameter(logits, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits[x.long().reshape(-1)]


def test_evaluation_sums_count_correct_predictions_and_clip_each_loss() -> None:
    # Three examples of two classes; the third is a confident miss whose loss exceeds the bound.
    logits = torch.tensor([[2.0, 0.0], [0.0, 1.0], [10.0, -10.0]])
    data = DeviceData(torch.arange(3.0), torch.tensor([0, 1, 1]))
    s = evaluation_sums(_Fixed(logits), data, loss_bound=5.0)
    each = torch.nn.functional.cross_entropy(logits, torch.tensor([0, 1, 1]), reduction="none").double()
    assert s.correct == 2 and s.count == 3
    assert s.loss == pytest.approx(float(each.sum()), rel=1e-12)
    assert s.clipped_loss == pytest.approx(float(each[0] + each[1]) + 5.0, rel=1e-12)
    assert s.accuracy == 2 / 3 and s.mean_loss == pytest.approx(float(each.mean()), rel=1e-12)
    assert evaluation_sums(_Fixed(logits), DeviceData(torch.zeros(0), torch.zeros(0, dtype=torch.long)),
                           5.0) == SetSums(0, 0.0, 0.0, 0)


def test_a_set_release_is_the_noisy_sums_divided_by_the_noisy_count() -> None:
    sums = SetSums(correct=700, loss=900.0, clipped_loss=800.0, count=1000)
    r = release_set(sums, noise_multiplier=3.0, loss_bound=5.0, generator=_gen(11))
    z = torch.randn(3, generator=_gen(11), dtype=torch.float64).tolist()
    count = 1000 + 3.0 * z[2]
    assert r.accuracy == (700 + 3.0 * z[0]) / count
    assert r.loss == (800.0 + 3.0 * 5.0 * z[1]) / count
    assert r.count == round(count)
    assert (r.accuracy, r.loss) != (0.7, 0.8)  # noised


def test_a_release_is_clipped_into_the_valid_range_and_divides_by_at_least_one() -> None:
    # A tiny set and much noise: the noisy count falls below 1 and the ratios leave their ranges.
    sums = SetSums(correct=1, loss=2.0, clipped_loss=2.0, count=1)
    g = _gen(3)
    z = torch.randn(3, generator=_gen(3), dtype=torch.float64).tolist()
    r = release_set(sums, noise_multiplier=50.0, loss_bound=5.0, generator=g)
    count = 1 + 50.0 * z[2]
    denominator = max(count, 1.0)
    assert r.accuracy == min(max((1 + 50.0 * z[0]) / denominator, 0.0), 1.0)
    assert r.loss == min(max((2.0 + 250.0 * z[1]) / denominator, 0.0), 5.0)
    assert r.count == max(round(count), 0)
    assert 0.0 <= r.accuracy <= 1.0 and 0.0 <= r.loss <= 5.0 and r.count >= 0


def test_one_set_is_one_gaussian_of_sensitivity_root_three() -> None:
    # correct ±1, clipped loss sum ±B, count ±1, each in units of its noise (σ, σB, σ): √3 together.
    assert set_release(6.0, sets=2) == Release(1.0, 6.0 / math.sqrt(3.0), 2)


def test_released_figures_are_named_as_the_upload_carries_them() -> None:
    from hetfed.client.privacy.metrics import ReleasedSet

    out = released_figures({"test": ReleasedSet(0.5, 1.25, 998), "ood": ReleasedSet(0.25, 2.0, 10)})
    assert out == {"test_accuracy": 0.5, "test_loss": 1.25, "num_test_examples": 998.0, "ood_accuracy": 0.25,
                   "ood_loss": 2.0}


def _exact() -> EvalMetrics:
    return EvalMetrics(train_loss=0.31, num_train_examples=600, test_accuracy=0.82, test_loss=0.55,
                       num_test_examples=200, extra={"evaluated_round": 3.0, "ood_accuracy": 0.6, "ood_loss": 1.1,
                                                     "global_model_test_accuracy": 0.7,
                                                     "train_cpu_seconds": 4.0})


def test_the_gate_withholds_every_figure_of_private_data_by_default() -> None:
    out = gate(_exact(), {})
    assert (out.train_loss, out.num_train_examples, out.test_accuracy, out.test_loss, out.num_test_examples) == (
        0.0, 0, 0.0, 0.0, 0)
    assert out.extra == {"evaluated_round": 3.0}
    assert out.withheld == ("train_loss", "num_train_examples", "test_accuracy", "test_loss", "num_test_examples",
                            "ood_accuracy", "ood_loss", "global_model_test_accuracy", "train_cpu_seconds")
    assert out.figure("test_accuracy") is None and out.figure("evaluated_round") == 3.0


def test_the_gate_lets_released_figures_through_and_nothing_else() -> None:
    released = {"test_accuracy": 0.79, "test_loss": 0.6, "num_test_examples": 203.0, "ood_accuracy": 0.58,
                "ood_loss": 1.3}
    out = gate(_exact(), released)
    assert (out.test_accuracy, out.test_loss, out.num_test_examples) == (0.79, 0.6, 203)
    assert out.extra == {"evaluated_round": 3.0, "ood_accuracy": 0.58, "ood_loss": 1.3}
    assert out.withheld == ("train_loss", "num_train_examples", "global_model_test_accuracy", "train_cpu_seconds")


@pytest.mark.parametrize("field", ["metrics_noise_multiple", "metric_loss_bound"])
def test_metric_settings_must_be_positive(field: str) -> None:
    with pytest.raises(ConfigError, match=rf"{field} must be a number > 0"):
        PrivacyConfig(noise_multiplier=1.0, **{field: 0.0})  # type: ignore[arg-type]


def _session(tmp_path: Path, **kw: object) -> PrivacySession:
    cfg = PrivacyConfig(noise_seed=5, delta=1e-5, **kw)  # type: ignore[arg-type]
    s = PrivacySession(cfg, "r", "org", str(tmp_path), 1000, CPU)
    s.release_examples()
    s.set_batch_size(50)
    return s


def test_the_sigma_plan_includes_the_metric_releases(tmp_path: Path) -> None:
    s = _session(tmp_path, target_epsilon=3.0, release_metrics=True)
    per_round = [Release(0.05, 1.0, 20)]
    evaluations = s.evaluation_plan(sets=2, evaluations=5)
    assert evaluations == [Release(1.0, 30.0 / math.sqrt(3.0), 10)]
    sigma = s.plan("dp-sgd", [], per_round, 4, evaluations)
    spent = epsilon_of([Release(0.05, sigma, 80), Release(1.0, 30.0 * sigma / math.sqrt(3.0), 10)], 1e-5)
    assert spent <= 3.0 * (1 + 1e-9)
    without = _session(tmp_path / "b", target_epsilon=3.0).plan("dp-sgd", [], per_round, 4, [])
    assert sigma > without  # the releases cost ε, so σ rises
    assert _session(tmp_path / "c", target_epsilon=3.0).evaluation_plan(sets=2, evaluations=5) == []


def test_a_release_is_recorded_before_the_upload_and_its_figures_pass_the_gate(tmp_path: Path) -> None:
    s = _session(tmp_path, noise_multiplier=1.5, release_metrics=True, metrics_noise_multiple=4.0)
    s.plan("dp-sgd", [], [Release(0.05, 1.0, 20)], 4)
    sums = {"test": SetSums(150, 90.0, 80.0, 200), "ood": SetSums(40, 70.0, 60.0, 100)}
    s.release_evaluation(sums, generator=_gen(9))
    g = _gen(9)
    want_test = release_set(sums["test"], 6.0, 5.0, g)
    want_ood = release_set(sums["ood"], 6.0, 5.0, g)
    assert s.ledger.pending == [Release(1.0, 6.0 / math.sqrt(3.0), 2)]
    assert s.released == released_figures({"test": want_test, "ood": want_ood})
    out = s.protect(_exact())
    assert out.test_accuracy == want_test.accuracy and out.num_test_examples == want_test.count
    assert out.extra["ood_loss"] == want_ood.loss
    # ε composes the example count's release (σ_N = 20, made before anything else) with the two metric releases.
    assert s.close_round(1).epsilon == pytest.approx(
        epsilon_of([Release(1.0, 20.0), Release(1.0, 6.0 / math.sqrt(3.0), 2)], 1e-5), rel=1e-12)
    s.withhold_evaluation()
    assert s.protect(_exact()).withheld[:5] == EvalMetrics.FIELDS


def test_a_release_past_the_budget_is_withheld_instead(tmp_path: Path) -> None:
    s = _session(tmp_path, noise_multiplier=1.0, epsilon_budget=0.5, release_metrics=True,
                 metrics_noise_multiple=1.0)
    s.plan("dp-sgd", [], [], 1)
    s.release_evaluation({"test": SetSums(150, 90.0, 80.0, 200)}, generator=_gen(1))
    assert s.released == {} and s.ledger.pending == []


def test_a_release_past_the_target_alone_is_withheld_too(tmp_path: Path) -> None:
    """With only target_epsilon, the target is the budget (as for the training rounds): a metric release whose
    noise would take ε past it (σ_m = 0.01σ) is withheld, not sent."""
    s = _session(tmp_path, target_epsilon=1.0, release_metrics=True, metrics_noise_multiple=0.01)
    s.plan("dp-sgd", [], [Release(0.05, 1.0, 20)], 1)
    s.release_evaluation({"test": SetSums(150, 90.0, 80.0, 200)}, generator=_gen(1))
    assert s.released == {} and s.ledger.pending == []


def test_the_card_of_a_model_trained_outside_dp_carries_no_epsilon(tmp_path: Path) -> None:
    from hetfed.client.export import NOT_DP_NOTE, card_privacy

    privacy = {"epsilon": 2.5, "delta": 1e-5, "noise_multiplier": 1.1, "clip_norm": 1.0}
    assert card_privacy(privacy, model_under_dp=False) == {"differentially_private": False, "note": NOT_DP_NOTE}
    assert card_privacy(privacy, model_under_dp=True) == {**privacy, "differentially_private": True}
    assert card_privacy(None, model_under_dp=False) is None and card_privacy({}, model_under_dp=True) is None


def test_dittos_deployed_model_is_declared_outside_dp_and_the_others_inside() -> None:
    from hetfed.client.algorithms.ditto.client import DittoClient
    from hetfed.client.algorithms.fedavg import FedAvgClient

    assert DittoClient.deployed_under_dp is False and FedAvgClient.deployed_under_dp is True


def _context(tmp_path: Path, **privacy: object) -> tuple[object, PrivacySession]:
    from hetfed.client.algorithms.base import ClientContext
    from hetfed.client.data import DataConfig, load_client_data
    from hetfed.client.models import build_model
    from hetfed.wire.specs import get_spec

    data = load_client_data(DataConfig(dataset="synthetic", partition="natural", num_clients=2, client_index=0,
                                       seed=3, synthetic_samples=120))
    session = PrivacySession(PrivacyConfig(noise_multiplier=1.0, noise_seed=4, delta=1e-5, **privacy),  # type: ignore[arg-type]
                             "r", "org-0", str(tmp_path), len(data.train), CPU)
    session.release_examples()
    session.set_batch_size(10)
    session.plan("dp-sgd", [], [Release(session.q, 1.0, 1)], 2)
    config = get_spec("ditto").config(batch_size=10, local_steps=1)

    def build() -> nn.Module:
        return build_model("linear", data.input_shape, data.num_classes, seed=3)

    ctx = ClientContext("org-0", build(), data, CPU, config, 3, build_model=build, privacy=session)  # type: ignore[arg-type]
    session.begin_round(1, 10)
    return ctx, session


def test_the_context_releases_its_own_models_evaluation_and_withholds_a_kept_models(tmp_path: Path) -> None:
    ctx, session = _context(tmp_path, release_metrics=True)
    exact = ctx.metrics(0.4, evaluated_round=0)  # type: ignore[attr-defined]
    # The exact figures stay with the organization; the gate sends the released ones, recorded in the ledger.
    assert exact.test_accuracy == pytest.approx(evaluation_sums(ctx.model, ctx.test, 5.0).accuracy)  # type: ignore[attr-defined]
    assert session.ledger.pending == [Release(1.0, 30.0 / math.sqrt(3.0), 1)]
    sent = session.protect(exact)
    assert sent.withheld == ("train_loss", "num_train_examples")
    assert sent.test_accuracy == session.released["test_accuracy"] != exact.test_accuracy
    # A model trained beside the organization's (Ditto's personal model): nothing released, nothing recorded.
    ctx.metrics(0.4, evaluated_round=1, model=ctx.build_model())  # type: ignore[attr-defined]
    assert session.released == {} and session.ledger.pending == [Release(1.0, 30.0 / math.sqrt(3.0), 1)]
    assert session.protect(exact).withheld[:5] == EvalMetrics.FIELDS


def test_without_release_metrics_nothing_is_recorded(tmp_path: Path) -> None:
    ctx, session = _context(tmp_path)
    exact = ctx.metrics(0.4, evaluated_round=0)  # type: ignore[attr-defined]
    assert session.ledger.pending == [] and session.released == {}
    assert session.protect(exact).extra == {"evaluated_round": 0.0}
