"""Distributed DP's sensitivity through the wired client path: Fed-CMA's real client half computes its clipped
class sums and counts (``class_means`` under a run's distributed plan), ``summed_fields`` gives their weighted form
as the secure round does, and the plan clips, scales, rotates and rounds it (``DistributedSum.rounded``, the
pre-noise integer vector). Adding or removing one example, adversarial ones included, moves the float vector by at
most Δ = √(C_z² + 1) and the integer vector by at most the Δ2 and Δ1 the ledger records (``Plan.sensitivity_bounds``),
when both neighbours round with the same uniforms (the coupling the bound rests on). Float64, fixed seeds."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from hetfed.client.privacy.ledger import DistributedRelease
from hetfed.client.secure import summed_fields
from hetfed.wire.payloads import PayloadKind
from hetfed.wire.specs import get_spec
from tests.client.test_privacy_neighbours import BASE, FEDCMA, HUGE, RARE, examples, private_half

torch.set_num_threads(1)
pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")

CME = PayloadKind.CLASS_MEAN_EMBEDDINGS
PLAN = get_spec("fedcma_paper").config(**FEDCMA, ddp_epsilon=1.0).distributed_sum(4, 5)
ROTATION = 77


def _rounded(x: torch.Tensor, y: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(the weighted form as one float vector, its pre-noise integer vector) on training set (x, y)."""
    half = private_half("fedcma_paper", x, y)
    assert PLAN is not None
    half.ctx.distributed = PLAN
    values = summed_fields([half.class_means()], frozenset({CME}), False)
    pending = half.ctx.privacy.ledger._pending_distributed  # type: ignore[union-attr]
    assert pending == [DistributedRelease.of(PLAN.plan)]  # the round's release, recorded before anything leaves
    return PLAN.vector(values), PLAN.rounded(values, ROTATION, np.random.default_rng(3))


@pytest.mark.parametrize("added", ["huge", "rare", "plain"])
def test_one_example_moves_the_pre_noise_integer_vector_by_at_most_the_recorded_sensitivity(added: str) -> None:
    assert PLAN is not None
    extra = {"huge": HUGE, "rare": RARE, "plain": examples(1, 6, [1])}[added]
    small = _rounded(*BASE)
    large = _rounded(torch.cat([BASE[0], extra[0]]), torch.cat([BASE[1], extra[1]]))
    l2, l1 = PLAN.plan.sensitivity_bounds()
    delta = math.sqrt(FEDCMA["latent_dim"] + 1)
    assert delta == get_spec("fedcma_paper").config(**FEDCMA).class_sum_sensitivity == PLAN.plan.sensitivity
    moved = float(np.linalg.norm(large[0] - small[0]))
    assert 1.0 <= moved <= delta * (1 + 1e-12)  # its count moves by 1, its clipped embedding by at most C_z
    step = (large[1] - small[1]).astype(np.float64)
    assert np.count_nonzero(step) > 0
    # The rounded vectors move by less than the scaled move plus one per coordinate: within Δ2 = sΔ + √D.
    assert float(np.linalg.norm(step)) <= PLAN.plan.scale * moved + math.sqrt(PLAN.plan.size)
    assert float(np.linalg.norm(step)) <= l2
    assert float(np.abs(step).sum()) <= l1
    # Removing it is the same pair read the other way.
    assert float(np.linalg.norm(-step)) <= l2


def test_every_embedding_is_clipped_to_the_latent_bound() -> None:
    """A sigmoid-bounded embedding already lies in [0, 1]^d_e, of norm at most √d_e, so the clip changes none and
    the class sums are the plain sums of the embeddings."""
    half = private_half("fedcma_paper", *BASE)
    sums, counts = half.clipped_class_sums()  # type: ignore[attr-defined]
    with torch.no_grad():
        z = half.ctx.model.embed(BASE[0]).double().numpy()
    y = BASE[1].numpy()
    expected = np.stack([z[y == k].sum(axis=0) for k in range(len(counts))])
    np.testing.assert_allclose(sums, expected, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(counts, np.bincount(y, minlength=len(counts)))
