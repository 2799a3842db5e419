"""FedRep under DP: each phase is DP-SGD on its own part. With σ = 0, q = 1, expected batch 1 and plain SGD at rate
1 (the neighbour test's setting, tests/client/test_privacy_neighbours.py), a phase's one step moves its part by
minus Σ_i clip_C(g_i) over that part's parameters and leaves the other part as it was. One example added moves
that sum by at most C, and by exactly its own clipped gradient. A round takes the steps the privacy plan counts."""

from __future__ import annotations

import math

import pytest
import torch

import hetfed.client.algorithms.fedrep as fedrep_client
import tests.client.test_privacy_neighbours as neighbours
from hetfed.client.privacy.mechanisms import PrivateData, PrivateStep
from hetfed.client.training import FitResult, steps_per_round

CLIP = neighbours.CLIP
# One epoch of the head, then one of the body: one Poisson step each at expected batch 1.
CASE = ("fedrep", {"local_steps": 0, "local_epochs": 2, "body_epochs": 1}, None)
Pair = tuple[torch.Tensor, torch.Tensor]


@pytest.fixture(autouse=True)
def _fedrep_case(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(neighbours.CASES, "fedrep", CASE)


def _private(x: torch.Tensor, y: torch.Tensor, sample_rate: float = 1.0) -> fedrep_client.FedRepClient:
    half = neighbours.private_half("fedrep", x, y)
    session = half.ctx.privacy
    assert session is not None and isinstance(half.ctx.train, PrivateData)
    session.begin_round(1, 11)
    step = half.ctx.train.step
    half.ctx.train.step = PrivateStep(0.0, CLIP, sample_rate, 1.0, step.generator, step.ledger, session.hooked)
    assert isinstance(half, fedrep_client.FedRepClient)
    return half


def _flat(half: fedrep_client.FedRepClient) -> dict[str, torch.Tensor]:
    parts = half.optimized()
    return {name: torch.cat([p.detach().reshape(-1) for p in params]) for name, params in parts.items()}


def moved(part: str, x: torch.Tensor, y: torch.Tensor, sample_rate: float = 1.0) -> dict[str, torch.Tensor]:
    """Minus the displacement of the head and of the body by one epoch of phase ``part`` on (x, y)."""
    half = _private(x, y, sample_rate)
    before = _flat(half)
    result = half.phase(part, 1, half.ctx.rng(11))
    assert result.steps == 1
    after = _flat(half)
    return {name: before[name] - after[name] for name in before}


@pytest.mark.parametrize("part", ["head", "body"])
def test_a_phase_is_dp_sgd_on_its_own_part_and_leaves_the_other(part: str) -> None:
    other = "body" if part == "head" else "head"
    base = neighbours.BASE
    on_d = moved(part, *base)
    assert torch.count_nonzero(on_d[other]) == 0
    assert neighbours.norm(on_d[part]) > 0.05
    for extra in (neighbours.HUGE, neighbours.RARE):
        with_e = moved(part, *neighbours.cat(base, extra))
        assert torch.count_nonzero(with_e[other]) == 0
        alone = moved(part, *extra)[part] - moved(part, *extra, sample_rate=0.0)[part]
        assert torch.allclose(with_e[part] - on_d[part], alone, rtol=0, atol=1e-10)
        assert neighbours.norm(alone) <= CLIP + 1e-12
    # The huge example's gradient is far beyond C: clipped to exactly C.
    huge = moved(part, *neighbours.cat(base, neighbours.HUGE))[part] - on_d[part]
    assert neighbours.norm(huge) == pytest.approx(CLIP, abs=1e-9)


def test_a_private_round_takes_the_steps_the_plan_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    half = _private(*neighbours.BASE)
    steps: list[int] = []
    real_fit = fedrep_client.fit

    def counted(objectives: object, batches: object) -> FitResult:
        result = real_fit(objectives, batches)  # type: ignore[arg-type]
        steps.append(result.steps)
        return result

    monkeypatch.setattr(fedrep_client, "fit", counted)
    half.train(1, 11, neighbours.NOTHING)
    config = half.config
    assert steps == [config.head_epochs * math.ceil(1 / config.batch_size), math.ceil(1 / config.batch_size)]
    assert sum(steps) == steps_per_round(half.ctx.num_examples, config)
