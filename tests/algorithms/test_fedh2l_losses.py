"""FedH2L's loss and projection modules against hand-computed and float64 references."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from hetfed.client.algorithms.base import ClientContext
from hetfed.client.algorithms.fedh2l import FedH2LClient
from hetfed.client.algorithms.fedh2l.losses import ConfidenceWeightedDistillation, ConflictProjection
from hetfed.client.data import DataConfig, load_client_data
from hetfed.client.losses import assign_flat_grad, flat_grad
from hetfed.client.models import build_model
from hetfed.wire.specs.fedh2l import FedH2LConfig


def _kl(p: list[float], z: list[float]) -> float:
    """KL(p ‖ softmax(z)) by hand, in float64."""
    zmax = max(z)
    log_norm = zmax + math.log(sum(math.exp(v - zmax) for v in z))
    return sum(pi * (math.log(pi) - (zi - log_norm)) for pi, zi in zip(p, z, strict=True) if pi > 0)


def _ce(z: list[float], y: int) -> float:
    zmax = max(z)
    return -(z[y] - zmax - math.log(sum(math.exp(v - zmax) for v in z)))


def test_distillation_matches_eqs_3_to_5_by_hand() -> None:
    z1 = [[1.0, 0.0, -1.0], [0.5, 0.5, 2.0]]
    z2 = [[0.0, 3.0, 0.0]]
    p1 = [[0.7, 0.2, 0.1], [0.0, 0.5, 0.5]]  # a zero probability contributes 0·log 0 = 0
    p2 = [[0.1, 0.8, 0.1]]
    y1, y2 = [0, 2], [1]
    acc = [0.5, 0.25]
    loss = ConfidenceWeightedDistillation()
    total, kl, ce = loss([torch.tensor(z1, dtype=torch.float64), torch.tensor(z2, dtype=torch.float64)],
                         [torch.tensor(p1, dtype=torch.float64), torch.tensor(p2, dtype=torch.float64)], acc,
                         [torch.tensor(y1), torch.tensor(y2)])
    # (1/T)·Σ_j Acc_j·mean_b KL(p_j ‖ q_j) and (1/T)·Σ_j mean_b CE, T = 2 teachers.
    want_kl = (acc[0] * (_kl(p1[0], z1[0]) + _kl(p1[1], z1[1])) / 2 + acc[1] * _kl(p2[0], z2[0])) / 2
    want_ce = ((_ce(z1[0], 0) + _ce(z1[1], 2)) / 2 + _ce(z2[0], 1)) / 2
    assert float(kl) == pytest.approx(want_kl, rel=1e-12)
    assert float(ce) == pytest.approx(want_ce, rel=1e-12)
    assert float(total) == pytest.approx(want_kl + want_ce, rel=1e-12)


def test_kl_direction_is_teacher_to_student() -> None:
    p, z = [0.9, 0.05, 0.05], [0.0, 1.0, 0.0]
    q = torch.softmax(torch.tensor(z, dtype=torch.float64), 0).tolist()
    _, kl, _ = ConfidenceWeightedDistillation(labelled=False)([torch.tensor([z], dtype=torch.float64)],
                                                              [torch.tensor([p], dtype=torch.float64)], [1.0])
    forward = sum(a * math.log(a / b) for a, b in zip(p, q, strict=True))
    reverse = sum(b * math.log(b / a) for a, b in zip(p, q, strict=True))
    assert float(kl) == pytest.approx(forward, rel=1e-12)
    assert abs(forward - reverse) > 1e-2


def test_confidence_weights_and_unlabelled_seed_data() -> None:
    torch.manual_seed(0)
    z = [torch.randn(4, 5, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    p = [torch.softmax(torch.randn(4, 5, dtype=torch.float64), 1) for _ in range(2)]
    unlabelled = ConfidenceWeightedDistillation(labelled=False)
    total, kl, ce = unlabelled(z, p, [0.0, 1.0])
    assert float(ce) == 0.0 and float(total.detach()) == float(kl.detach())
    # A teacher with Acc_j = 0 adds nothing; the other keeps its 1/T share.
    _, alone, _ = unlabelled(z[1:], p[1:], [1.0])
    assert float(kl.detach()) == pytest.approx(float(alone.detach()) / 2, rel=1e-12)
    # Gradients reach the student only: the teachers' posteriors are constants.
    teacher = p[1].clone().requires_grad_(True)
    unlabelled(z[1:], [teacher], [0.5])[0].backward()
    assert teacher.grad is None and z[1].grad is not None
    with pytest.raises(ValueError, match="labels"):
        ConfidenceWeightedDistillation()(z, p, [1.0, 1.0])
    with pytest.raises(ValueError, match="per teacher"):
        unlabelled(z, p, [1.0])


def _reference_projection(g_pub: np.ndarray, g_loc: np.ndarray) -> tuple[np.ndarray, float]:
    """Eq. 14 solved numerically in float64: minimise ½v²‖g_loc‖² + ⟨g_pub, g_loc⟩v over v ≥ 0 on a fine grid,
    refined by the stationarity condition; g̃ = v·g_loc + g_pub."""
    a, b = float(g_loc @ g_loc), float(g_pub @ g_loc)
    grid = np.linspace(0.0, 10.0, 200001)
    v = float(grid[np.argmin(0.5 * grid**2 * a + b * grid)])
    return g_pub + v * g_loc, v


def test_projection_closed_form_matches_the_dual_qp_when_gradients_conflict() -> None:
    proj = ConflictProjection()
    # By hand: ⟨g_pub, g_loc⟩ = -1, ‖g_loc‖² = 2, v* = 0.5, g̃ = (0.5, 0.5), now orthogonal to g_loc.
    g, v = proj(torch.tensor([1.0, 0.0]), torch.tensor([-1.0, 1.0]))
    assert v == 0.5
    torch.testing.assert_close(g, torch.tensor([0.5, 0.5]))
    rng = np.random.default_rng(1)
    checked = 0
    for _ in range(50):
        g_pub, g_loc = rng.normal(size=7), rng.normal(size=7)
        if g_pub @ g_loc >= 0:
            continue
        want, v_ref = _reference_projection(g_pub, g_loc)
        got, v = proj(torch.tensor(g_pub, dtype=torch.float32), torch.tensor(g_loc, dtype=torch.float32))
        assert got.dtype == torch.float32
        assert v == pytest.approx(v_ref, abs=1e-4)
        np.testing.assert_allclose(got.numpy(), g_pub + v * g_loc, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(got.numpy(), want, atol=1e-3)
        assert float(np.float64(got.numpy()) @ g_loc) >= -1e-5  # constraint (7) now holds
        # g̃ is the closest point to g_pub in the half-space {g : ⟨g, g_loc⟩ ≥ 0} (the primal QP).
        np.testing.assert_allclose(got.numpy(), g_pub - (g_pub @ g_loc) / (g_loc @ g_loc) * g_loc, atol=1e-5)
        checked += 1
    assert checked > 10


def test_projection_leaves_non_conflicting_gradients_alone() -> None:
    proj = ConflictProjection()
    g_pub = torch.tensor([1.0, 2.0, -1.0])
    for g_loc in (torch.tensor([1.0, 0.0, 0.0]), torch.tensor([1.0, 0.0, 1.0]), torch.zeros(3)):
        got, v = proj(g_pub, g_loc)  # ⟨g_pub, g_loc⟩ = 1, 0, 0: no conflict
        assert got is g_pub and v == 0.0


def test_projection_dot_products_are_float64() -> None:
    # ⟨g_pub, g_loc⟩ = 1e8 - 1 - 1e8 = -1 exactly in float64 (1e8 - 1 is not a float32), ‖g_loc‖² = 3.
    g_pub = torch.tensor([1e8, 1.0, -1e8], dtype=torch.float32)
    g_loc = torch.tensor([1.0, -1.0, 1.0], dtype=torch.float32)
    g, v = ConflictProjection()(g_pub, g_loc)
    assert v == 1.0 / 3.0
    torch.testing.assert_close(g, (g_pub.double() + g_loc.double() / 3).float())


def test_flat_gradients_cover_trainable_parameters_with_zeros_for_missing_grads() -> None:
    a = torch.nn.Parameter(torch.ones(2, 2))
    b = torch.nn.Parameter(torch.ones(3))
    (a.sum() * 2).backward()  # b gets no gradient
    flat = flat_grad([a, b])
    torch.testing.assert_close(flat, torch.tensor([2.0, 2, 2, 2, 0, 0, 0]))
    assign_flat_grad([a, b], torch.arange(7.0))
    torch.testing.assert_close(a.grad, torch.tensor([[0.0, 1.0], [2.0, 3.0]]))
    torch.testing.assert_close(b.grad, torch.tensor([4.0, 5.0, 6.0]))
    with pytest.raises(ValueError, match="7"):
        assign_flat_grad([a], torch.arange(7.0))


def test_client_learn_step_takes_the_projected_gradient() -> None:
    """FedH2LClient.learn hands the second optimiser g̃ = project(g_pub, g_loc), exactly eq. 14's."""

    def node(i: int, project: bool = True) -> FedH2LClient:
        return _node(i, project=project)

    weights = _weights
    rng = np.random.default_rng(0)
    teacher_node = node(1)
    teacher_node.local(rng)
    teacher = teacher_node.teach(rng)
    lo, hi = teacher_node.own_part.min(), teacher_node.own_part.max()
    assert lo <= teacher.indices.min() and teacher.indices.max() <= hi  # taught on its own domain's part
    np.testing.assert_allclose(teacher.probabilities.sum(1), 1, atol=1e-6)
    assert 0 <= teacher.teaching_confidence <= 1
    # g_pub of the student, read off a plain SGD step without projection.
    free = node(0, project=False)
    free.g_loc = torch.zeros_like(weights(free))
    w0 = weights(free)
    free.learn((teacher,))
    g_pub = (w0 - weights(free)) / 0.1
    assert float(g_pub.norm()) > 0
    # g_loc = -g_pub conflicts: v* = 1 and g̃ = 0, so the global step leaves the weights where they are.
    opposed = node(0)
    opposed.g_loc = -g_pub
    stats = opposed.learn((teacher,))
    assert stats["projected"] == 1.0 and stats["projection_v"] == pytest.approx(1.0, rel=1e-4)
    torch.testing.assert_close(weights(opposed), w0, rtol=0, atol=1e-6)
    # g_loc = g_pub does not conflict: the step is the unprojected one.
    agreeing = node(0)
    agreeing.g_loc = g_pub.clone()
    stats = agreeing.learn((teacher,))
    assert stats["projected"] == 0.0 and agreeing.g_loc is None
    torch.testing.assert_close(weights(agreeing), weights(free))


def _node(i: int, **cfg: object) -> FedH2LClient:
    """An mlp node of a two-domain rotated federation with plain SGD (lr 0.1), so steps are lr·gradient."""
    config = FedH2LConfig(**{"optimizer": "sgd", "lr": 0.1, "weight_decay": 0.0, "batch_size": 8, **cfg})  # type: ignore[arg-type]
    data = load_client_data(DataConfig(dataset="mnist5k", partition="rotated", num_clients=2, client_index=i))
    model = build_model("mlp", data.input_shape, data.num_classes, seed=i)
    return FedH2LClient(ClientContext(f"org-{i}", model, data, torch.device("cpu"), config, 0))


def _weights(node: FedH2LClient) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in node.params]).clone()


def test_with_e_local_steps_g_loc_is_the_displacement() -> None:
    node = _node(0, local_steps=3)
    w0 = _weights(node)
    node.local(np.random.default_rng(0))
    w1 = _weights(node)
    torch.testing.assert_close(node.g_loc, w0 - w1)
    # E = 1: g_loc is the gradient itself, and plain SGD moved the weights by lr·g_loc.
    one = _node(0)
    w0 = _weights(one)
    one.local(np.random.default_rng(0))
    w1 = _weights(one)
    torch.testing.assert_close(0.1 * one.g_loc, w0 - w1)


def test_unlabelled_seed_data_uses_kl_only_and_private_accuracy_as_confidence() -> None:
    teacher_node, student = _node(1, labelled_seed=False), _node(0, labelled_seed=False)
    rng = np.random.default_rng(0)
    teacher_node.local(rng)
    teacher = teacher_node.teach(rng)
    assert teacher.teaching_confidence == teacher_node.private_batch_accuracy
    student.local(rng)
    stats = student.learn((teacher,))
    assert stats["loss_ce_pub"] == 0.0 and stats["loss_kl"] > 0
