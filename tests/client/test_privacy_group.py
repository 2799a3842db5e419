"""Group-level DP-SGD (``privacy.unit = "group"``): per-group clipping against hand computations, the group Poisson
sampler and its cap against the generator's own sequence, the neighbouring bound for a whole group, the refusals,
and the accounting at the group sampling rate."""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting import rdp
from torch import nn

from hetfed.client.privacy.config import PrivacyConfig
from hetfed.client.privacy.ledger import Ledger, Release, solve_noise_multiplier
from hetfed.client.privacy.mechanisms import PrivacyError, PrivateData, PrivateStep, clip_and_sum
from hetfed.client.privacy.session import PrivacySession
from hetfed.client.training import Batch, DeviceData, Objective, cross_entropy, epoch_batches, fit
from hetfed.wire.config import ConfigError
from hetfed.wire.specs import TrainConfig

torch.set_num_threads(1)
pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")
CPU = torch.device("cpu")


def ledger() -> Ledger:
    return Ledger("run", "org", 1e-5, "rdp", 1.0, 1.0)


# ---------------------------------------------------------------------------------------------- per-group clipping
def test_clip_and_sum_clips_each_groups_summed_gradient_exactly() -> None:
    """Groups of 1, 2 and 3 examples, interleaved in the batch, two parameters (w of 2, b of 1), C = 1:
    group 0 sums to (3, 0 | 4), norm 5, clipped to (0.6, 0 | 0.8); group 1 to (0, 6 | 8), norm 10, clipped to
    (0, 0.6 | 0.8); group 2 to (0.25, 0.25 | 0.5), norm √0.375 < 1, kept. Total (0.85, 0.85 | 2.1). Clipping
    each record instead gives (0.85, 1.25 | 2.3)."""
    rows = {  # example -> (group, w, b)
        0: (1, [0.0, 6.0], [0.0]),
        1: (2, [0.25, 0.0], [0.0]),
        2: (0, [3.0, 0.0], [4.0]),
        3: (2, [0.0, 0.25], [0.0]),
        4: (1, [0.0, 0.0], [8.0]),
        5: (2, [0.0, 0.0], [0.5]),
    }
    groups = torch.tensor([rows[i][0] for i in range(6)])
    w = torch.tensor([rows[i][1] for i in range(6)], dtype=torch.float64)
    b = torch.tensor([rows[i][2] for i in range(6)], dtype=torch.float64)
    got_w, got_b = clip_and_sum([w, b], 1.0, groups)
    assert torch.allclose(got_w, torch.tensor([0.85, 0.85], dtype=torch.float64), rtol=0, atol=1e-12)
    assert torch.allclose(got_b, torch.tensor([2.1], dtype=torch.float64), rtol=0, atol=1e-12)
    # Per record: (0, 1 | 0) + (0.25, 0 | 0) + (0.6, 0 | 0.8) + (0, 0.25 | 0) + (0, 0 | 1) + (0, 0 | 0.5).
    rec_w, rec_b = clip_and_sum([w, b], 1.0)
    assert torch.allclose(rec_w, torch.tensor([0.85, 1.25], dtype=torch.float64), rtol=0, atol=1e-12)
    assert torch.allclose(rec_b, torch.tensor([2.3], dtype=torch.float64), rtol=0, atol=1e-12)


def hand_group_gradient(weight: np.ndarray, bias: np.ndarray, x: np.ndarray, y: np.ndarray, groups: np.ndarray,
                        clip: float) -> tuple[np.ndarray, np.ndarray]:
    """Σ_g clip_C(Σ_{i in g} ∇CE_i) for a linear softmax model, with ∇_W CE_i = (p_i − e_{y_i}) x_iᵀ and
    ∇_b CE_i = p_i − e_{y_i}, p_i = softmax(W x_i + b); float64 numpy, no autograd."""
    logits = x @ weight.T + bias
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    d = p - np.eye(weight.shape[0])[y]
    total_w, total_b = np.zeros_like(weight), np.zeros_like(bias)
    for g in np.unique(groups):
        gw = sum(np.outer(d[i], x[i]) for i in np.flatnonzero(groups == g))
        gb = d[groups == g].sum(0)
        factor = min(1.0, clip / math.sqrt(float((gw**2).sum() + (gb**2).sum())))
        total_w += factor * gw
        total_b += factor * gb
    return total_w, total_b


def six() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """6 examples of 3 features in groups of sizes 1, 2 and 3 (interleaved), 2 classes."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 3, generator=g, dtype=torch.float64) * torch.tensor([[0.5], [2.0], [1.0], [4.0], [0.3], [3.0]],
                                                                         dtype=torch.float64)
    return x, torch.tensor([0, 1, 1, 0, 1, 0]), torch.tensor([2, 1, 2, 0, 1, 2])


def test_a_group_step_through_fit_is_the_hand_computed_clipped_group_sum() -> None:
    """σ = 0: the gradient ``fit`` hands the optimiser is Σ_g clip_C(Σ_{i in g} g_i) over the expected number of
    groups (2.5), to 1e-12 against the closed-form gradients of a linear softmax model; C = 2.0 clips some
    groups and not others."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2).double()
    weight = model.weight.detach().numpy().copy()
    bias = model.bias.detach().numpy().copy()
    x, y, groups = six()
    want_w, want_b = hand_group_gradient(weight, bias, x.numpy(), y.numpy(), groups.numpy(), 2.0)
    norms = []
    for gr in range(3):
        gw, gb = hand_group_gradient(weight, bias, x.numpy()[groups == gr], y.numpy()[groups == gr],
                                     np.zeros(int((groups == gr).sum()), dtype=np.int64), 1e9)
        norms.append(math.sqrt(float((gw**2).sum() + (gb**2).sum())))
    assert min(norms) < 2.0 < max(norms)  # the case covers both sides of C
    seen: list[torch.Tensor] = []
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = PrivateStep(0.0, 2.0, 0.5, 2.5, torch.Generator().manual_seed(0), ledger(), grouped=True)
    fit([Objective(model, opt, [cross_entropy],
                   before_step=lambda: seen.extend(p.grad.detach().clone() for p in model.parameters()))],  # type: ignore[union-attr]
        [Batch(x, y, private=step, groups=groups)])
    assert torch.allclose(seen[0], torch.from_numpy(want_w) / 2.5, rtol=0, atol=1e-12)
    assert torch.allclose(seen[1], torch.from_numpy(want_b) / 2.5, rtol=0, atol=1e-12)


def test_a_private_batch_without_group_ids_is_refused_under_group_privacy() -> None:
    """A step built for groups refuses a batch that lost its group ids instead of clipping per record."""
    model = nn.Linear(3, 2).double()
    x, y, _ = six()
    step = PrivateStep(1.0, 1.0, 0.5, 2.5, torch.Generator().manual_seed(0), ledger(), grouped=True)
    with pytest.raises(PrivacyError, match=r"carries no group ids under privacy\.unit = \"group\""):
        fit([Objective(model, torch.optim.SGD(model.parameters(), lr=0.1))], [Batch(x, y, private=step)])


def step_sum(model: nn.Module, x: torch.Tensor, y: torch.Tensor, groups: torch.Tensor, clip: float) -> torch.Tensor:
    """The σ = 0 step's clipped group sum (the gradient times the expected batch 1), flattened over parameters."""
    m = nn.Linear(3, 2).double()
    m.load_state_dict(model.state_dict())
    seen: list[torch.Tensor] = []
    step = PrivateStep(0.0, clip, 0.5, 1.0, torch.Generator().manual_seed(0), ledger(), grouped=True)
    fit([Objective(m, torch.optim.SGD(m.parameters(), lr=0.0),
                   before_step=lambda: seen.extend(p.grad.detach().reshape(-1).clone() for p in m.parameters()))],  # type: ignore[union-attr]
        [Batch(x, y, private=step, groups=groups)])
    return torch.cat(seen)


def test_adding_or_removing_a_whole_group_moves_the_clipped_sum_by_at_most_c() -> None:
    """Neighbours at group level, on adversarial data: a group of max_examples_per_group = 8 examples whose inputs
    are 1000 times larger and all alike (their gradients add up instead of cancelling) moves the step's clipped
    sum by exactly C = 0.5 at most, whatever the others hold; clipped per record the same group moves it by
    about 8·C."""
    torch.manual_seed(1)
    model = nn.Linear(3, 2).double()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(12, 3, generator=g, dtype=torch.float64) * 3
    y = torch.randint(0, 2, (12,), generator=g)
    groups = torch.arange(12) % 5
    loud = torch.tensor([[1000.0, -1000.0, 500.0]], dtype=torch.float64).repeat(8, 1)
    wrong = 1 - int(model(loud[:1]).argmax())  # the label that gives the loud inputs their largest gradient
    without = step_sum(model, x, y, groups, 0.5)
    for label in (wrong, 1 - wrong):
        with_group = step_sum(model, torch.cat([x, loud]), torch.cat([y, torch.full((8,), label)]),
                              torch.cat([groups, torch.full((8,), 5)]), 0.5)
        assert float((with_group - without).norm()) <= 0.5 + 1e-12
    # The wrong label: the group's summed gradient is far above C, so it moves the sum by C exactly.
    with_group = step_sum(model, torch.cat([x, loud]), torch.cat([y, torch.full((8,), wrong)]),
                          torch.cat([groups, torch.full((8,), 5)]), 0.5)
    assert float((with_group - without).norm()) == pytest.approx(0.5, abs=1e-9)
    per_record = step_sum(model, torch.cat([x, loud]), torch.cat([y, torch.full((8,), wrong)]),
                          torch.cat([groups, torch.arange(8) + 5]), 0.5)
    assert float((per_record - without).norm()) == pytest.approx(8 * 0.5, abs=1e-6)


# ---------------------------------------------------------------------------------------------- the group sampler
def indexed(n: int) -> DeviceData:
    """x[i] = (i, i), y[i] = i mod 10: a batch's rows say which examples it holds."""
    idx = torch.arange(n, dtype=torch.float32)
    return DeviceData(torch.stack([idx, idx], 1), torch.arange(n) % 10)


def patients() -> np.ndarray:
    """300 examples: 50 patients of 4 (ids 0 .. 49, scattered), and patient 999 with 100 examples."""
    ids = np.concatenate([np.repeat(np.arange(50), 4), np.full(100, 999)])
    return ids[np.random.default_rng(0).permutation(300)]


def test_group_sampler_draws_whole_groups_from_the_generators_sequence() -> None:
    """Each step: one uniform per group (in id order) against q, then for a group above the cap a permutation
    of its members from the same generator, the first max_examples_per_group kept. The batches equal that
    sequence replayed on a generator of the same seed, and each batch says every example's group."""
    ids, q, cap, steps = patients(), 0.2, 8, 30
    step = PrivateStep(1.0, 1.0, q, q * 51, torch.Generator().manual_seed(7), ledger(), grouped=True)
    data = PrivateData(indexed(300), step, ids, cap)
    assert data.num_groups == 51 and len(data) == 300
    replay = torch.Generator().manual_seed(7)
    members = [np.flatnonzero(ids == g) for g in np.unique(ids)]  # in data order
    sizes = []
    for batch in data.poisson_batches(steps):
        assert batch.private is step and batch.groups is not None
        chosen = (torch.rand(51, generator=replay) < q).nonzero().reshape(-1).tolist()
        rows, index = [], []
        for j, g in enumerate(chosen):
            m = members[g]
            if len(m) > cap:
                m = np.sort(m[torch.randperm(len(m), generator=replay)[:cap].numpy()])
            rows.extend(m.tolist())
            index.extend([j] * len(m))
        assert batch.x[:, 0].long().tolist() == rows
        assert batch.groups.tolist() == index
        sizes.append(len(chosen))
    assert sum(sizes) > 0 and len(sizes) == steps


class Rows(torch.utils.data.Dataset[tuple[torch.Tensor, int]]):
    """Example i is ((i, i), i mod 10), read one at a time as a factory's dataset is."""

    def __len__(self) -> int:
        return 300

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.tensor([float(i), float(i)]), i % 10


def test_group_batches_of_a_streamed_set_keep_each_rows_group() -> None:
    """A streamed set reads every draw before its batches: each batch still gets its own group index, the same
    rows and groups as the resident set gives from the same seed."""
    from hetfed.client.data.core import StreamedDataset
    from hetfed.client.training import StreamData

    ids = patients()
    streamed = StreamData(StreamedDataset(Rows(), np.arange(300) % 10, (2,), groups=ids), CPU)

    def batches(data: DeviceData | StreamData) -> list[tuple[list[int], list[int]]]:
        step = PrivateStep(1.0, 1.0, 0.2, 10.2, torch.Generator().manual_seed(9), ledger(), grouped=True)
        return [(b.x[:, 0].long().tolist(), b.groups.tolist())  # type: ignore[union-attr]
                for b in PrivateData(data, step, ids, 8).poisson_batches(12)]

    got = batches(streamed)
    assert got == batches(indexed(300)) and sum(len(rows) for rows, _ in got) > 0


def test_group_sampler_rate_is_q_per_group() -> None:
    """Over 2,000 seeded steps each of the 51 groups is in a batch at rate q = 0.1: the pooled rate is within 5
    standard errors √(q(1−q)/(51·2000)), and the number of groups per batch has variance Gq(1−q) (a binomial,
    not a fixed batch)."""
    ids, q, steps = patients(), 0.1, 2000
    step = PrivateStep(1.0, 1.0, q, q * 51, torch.Generator().manual_seed(3), ledger(), grouped=True)
    counts = [int(b.groups.max()) + 1 if len(b.groups) else 0  # type: ignore[union-attr]
              for b in PrivateData(indexed(300), step, ids, 8).poisson_batches(steps)]
    assert abs(np.mean(counts) / 51 - q) < 5 * math.sqrt(q * (1 - q) / (51 * steps))
    assert np.var(counts) == pytest.approx(51 * q * (1 - q), rel=0.2)


def test_the_cap_takes_max_examples_per_group_of_a_larger_group() -> None:
    """q = 1: patient 999's 100 examples come as 8 distinct ones of its own every step, a different 8 from
    step to step; patients of 4 (at most the cap) come whole."""
    ids = patients()
    step = PrivateStep(1.0, 1.0, 1.0, 51.0, torch.Generator().manual_seed(4), ledger(), grouped=True)
    picks = []
    for batch in PrivateData(indexed(300), step, ids, 8).poisson_batches(5):
        rows = batch.x[:, 0].long().numpy()
        assert len(rows) == 50 * 4 + 8 and len(set(rows.tolist())) == len(rows)
        big = rows[ids[rows] == 999]
        assert len(big) == 8
        picks.append(tuple(big.tolist()))
        assert batch.groups is not None and int(batch.groups.max()) == 50
    assert len(set(picks)) == 5


# ---------------------------------------------------------------------------------------------- the session
def group_session(cfg: PrivacyConfig) -> PrivacySession:
    """51 patients over 300 examples; the released group count Ĝ first, then a batch of 5 groups (q = 5/Ĝ)."""
    s = PrivacySession(cfg, "run", "org", None, 300, CPU, groups=patients())
    s.release_examples()
    s.set_batch_size(5)
    return s


def test_group_privacy_without_group_ids_is_refused_in_one_line() -> None:
    with pytest.raises(PrivacyError, match=r"^org: privacy\.unit = \"group\" needs a group id per training "
                                           r"example, and this organization's data gives none") as err:
        PrivacySession(PrivacyConfig(noise_multiplier=1.0, unit="group"), "run", "org", None, 300, CPU)
    assert "\n" not in str(err.value)
    # Record-level privacy ignores group ids the data may carry.
    s = PrivacySession(PrivacyConfig(noise_multiplier=1.0), "run", "org", None, 300, CPU, groups=patients())
    n_hat = s.release_examples()
    assert s.units == 300 and s.ledger.released == {"examples": n_hat} and s.delta == 1 / n_hat**2


def test_group_privacy_refuses_per_record_direct_releases() -> None:
    """Fed-CMA's class sums and counts are released per record: refused under unit = "group" when planned."""
    s = group_session(PrivacyConfig(noise_multiplier=1.0, unit="group"))
    with pytest.raises(PrivacyError, match=r"serves DP-SGD alone, and dp-sgd\+gaussian-sums also releases"):
        s.plan("dp-sgd+gaussian-sums", [Release(1.0, 10.0)], [Release(s.q, 1.0, 10)], 5)
    assert s.plan("dp-sgd", [], [Release(s.q, 1.0, 10)], 5) == 1.0


def test_released_metrics_are_refused_under_group_privacy() -> None:
    """A metric release bounds one held-out record, not a patient's many: refused in one line."""
    with pytest.raises(ConfigError, match=r"^release_metrics releases figures per record, and under unit = \"group\"") as err:
        PrivacyConfig(noise_multiplier=1.0, unit="group", release_metrics=True)
    assert "\n" not in str(err.value)
    assert PrivacyConfig(noise_multiplier=1.0, unit="record", release_metrics=True).release_metrics


def test_max_examples_per_group_is_checked() -> None:
    with pytest.raises(ConfigError, match=r"max_examples_per_group must be >= 1, got 0"):
        PrivacyConfig(noise_multiplier=1.0, unit="group", max_examples_per_group=0)
    assert PrivacyConfig().unit == "record" and PrivacyConfig().max_examples_per_group == 64


def test_group_accounting_is_the_poisson_sampled_gaussian_at_the_group_rate() -> None:
    """51 groups over 300 examples, released as Ĝ (the group count's Gaussian release, σ_N = 20), batch 5 groups:
    q = 5/Ĝ per group, the expected batch qĜ = 5 groups, δ = 1/Ĝ². A round of 10 steps through the training loop
    records 10 Poisson-sampled Gaussians at q, and ε is dp-accounting's for exactly those events and the count's
    release at δ = 1/Ĝ²."""
    sigma = 1.3
    s = group_session(PrivacyConfig(noise_multiplier=sigma, unit="group", max_examples_per_group=8, noise_seed=3))
    g_hat = s.num_examples
    assert s.units == 51 and s.ledger.released == {"groups": g_hat} and g_hat != 51
    assert s.q == 5 / g_hat and s.delta == 1 / g_hat**2
    s.plan("dp-sgd", [], [Release(s.q, 1.0, 10)], 1)
    g = torch.Generator().manual_seed(0)
    data = s.wrap(DeviceData(torch.randn(300, 3, generator=g), torch.randint(0, 2, (300,), generator=g)))
    s.begin_round(1, 0)
    assert data.step.expected_batch == pytest.approx(5.0, rel=1e-15) and data.step.grouped
    model = nn.Linear(3, 2)
    result = fit([Objective(model, torch.optim.SGD(model.parameters(), lr=0.1))],
                 epoch_batches(data, TrainConfig(local_steps=10, batch_size=30), np.random.default_rng(0)))
    assert result.steps == 10
    assert s.ledger.pending == [Release(s.q, sigma, 10)]
    eps = s.close_round(1).epsilon
    acc = rdp.RdpAccountant()
    acc.compose(dp_accounting.ComposedDpEvent([dp_accounting.GaussianDpEvent(20.0), dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(s.q, dp_accounting.GaussianDpEvent(sigma)), 10)]))
    assert eps == pytest.approx(acc.get_epsilon(1 / g_hat**2), rel=1e-12)


def test_the_planner_solves_sigma_at_the_group_rate_and_delta() -> None:
    """target ε = 2 over 5 rounds of 10 steps: σ is the one solved for q = 5/Ĝ and δ = 1/Ĝ², with the group count's
    release in the composition; not the one at the example count's δ."""
    s = group_session(PrivacyConfig(target_epsilon=2.0, unit="group", noise_seed=3))
    g_hat = s.num_examples
    sigma = s.plan("dp-sgd", [], [Release(s.q, 1.0, 10)], 5)
    count = [Release(1.0, 20.0)]
    assert sigma == solve_noise_multiplier([Release(5 / g_hat, 1.0, 50)], 2.0, 1 / g_hat**2, "rdp", count)
    assert sigma != solve_noise_multiplier([Release(5 / g_hat, 1.0, 50)], 2.0, 1 / 300**2, "rdp", count)


def test_the_client_hands_its_training_sets_group_ids_to_the_session() -> None:
    """The client's runtime gives the session the training set's group ids (3 patients, released as Ĝ: δ = 1/Ĝ²),
    and stops for good, in one line, before joining when ``unit = "group"`` meets data without them."""
    from hetfed.client.config import ClientConfig
    from hetfed.client.data.core import ArrayDataset, ClientData
    from hetfed.client.runtime import ClientError, ClientRuntime

    def data(groups: np.ndarray | None) -> ClientData:
        train = ArrayDataset(np.zeros((6, 2)), np.zeros(6), groups=groups)
        return ClientData(train=train, test=train, global_test=None, num_classes=2, input_shape=(2,), name="t")

    runtime = ClientRuntime(ClientConfig(organization="org", run="r",
                                         privacy=PrivacyConfig(noise_multiplier=1.0, unit="group",
                                                               ephemeral_ledger=True)))
    s = runtime._privacy_session(data(np.array([4, 4, 5, 5, 5, 9])), CPU)
    assert s is not None and s.units == 3 and s.ledger.released == {"groups": s.num_examples}
    assert s.delta == 1 / max(s.num_examples, 2) ** 2  # δ = 1/Û², Û at least 2 (as 1/N² always was)
    with pytest.raises(ClientError, match=r"^org: privacy\.unit = \"group\" needs a group id") as err:
        runtime._privacy_session(data(None), CPU)
    assert err.value.permanent and "\n" not in str(err.value)
