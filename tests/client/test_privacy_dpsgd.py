"""DP-SGD through the training loop: the privatised gradient of ``fit`` against a per-example computation by hand,
data-free terms outside the clipped sum, the decomposition check, the ledger entry of each batch, Poisson
sampling of the training set, and ``prepare_model`` (BatchNorm, channels-last convolutions)."""

from __future__ import annotations

import copy
import math
from collections import OrderedDict
from typing import cast

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from hetfed.client.models import build_model
from hetfed.client.privacy.config import PrivacyConfig
from hetfed.client.privacy.ledger import Ledger, Release
from hetfed.client.privacy.mechanisms import PrivacyError, PrivateData, PrivateStep, prepare_model
from hetfed.client.privacy.session import sigma_multiple
from hetfed.client.training import (
    Batch,
    DeviceData,
    Forward,
    Objective,
    PerExample,
    cross_entropy,
    data_free,
    epoch_batches,
    fit,
    sampled_batches,
    steps_per_round,
)
from hetfed.wire.specs import TrainConfig

torch.set_num_threads(1)
pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")

Q, EXPECTED = 0.25, 4.0  # the sample rate and expected batch the steps are built with (the batch below has 5)


def ledger() -> Ledger:
    return Ledger("run", "org", 1e-5, "rdp", 1.0, 1.0)


def tiny_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 3)).double()


def weight(model: nn.Module) -> torch.Tensor:
    """The weight of the Linear layer of ``tiny_model``."""
    return cast(nn.Linear, model.get_submodule("0")).weight


def grad(p: torch.Tensor) -> torch.Tensor:
    assert p.grad is not None
    return p.grad


def five() -> Batch:
    g = torch.Generator().manual_seed(1)
    return Batch(torch.randn(5, 4, generator=g, dtype=torch.float64) * 3, torch.tensor([0, 1, 2, 0, 1]))


def private_grads(model: nn.Module, terms: list, step: PrivateStep, batch: Batch) -> tuple[list[torch.Tensor], float]:  # type: ignore[type-arg]
    """The gradients the optimiser sees in one ``fit`` step on a private batch, and the step's loss."""
    seen: list[torch.Tensor] = []
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def grab() -> None:
        seen.extend(p.grad.detach().clone() for p in model.parameters())  # type: ignore[union-attr]

    batch = Batch(batch.x, batch.y, private=step)
    result = fit([Objective(model, opt, terms, before_step=grab)], [batch])
    return seen, result.loss


def by_hand(model: nn.Module, batch: Batch, clip: float) -> list[torch.Tensor]:
    """(Σ_i clip_C(∇ CE(x_i, y_i))) / expected batch, one example at a time."""
    params = list(model.parameters())
    total = [torch.zeros_like(p) for p in params]
    for i in range(batch.y.shape[0]):
        loss = F.cross_entropy(model(batch.x[i : i + 1]), batch.y[i : i + 1])
        grads = torch.autograd.grad(loss, params)
        norm = math.sqrt(sum(float((g**2).sum()) for g in grads))
        for t, g in zip(total, grads, strict=True):
            t += g * min(1.0, clip / norm)
    return [t / EXPECTED for t in total]


def test_private_step_gradient_is_the_clipped_sum_over_the_expected_batch() -> None:
    """σ = 0: the gradient ``fit`` hands the optimiser is Σ clipped per-example gradients over qN (not over the
    sample's actual size 5), to 1e-10 in float64; C = 0.5 clips some examples and not others."""
    model, batch = tiny_model(), five()
    ref = by_hand(copy.deepcopy(model), batch, 0.5)
    norms = []
    for i in range(5):
        m = copy.deepcopy(model)
        F.cross_entropy(m(batch.x[i : i + 1]), batch.y[i : i + 1]).backward()
        norms.append(math.sqrt(sum(float((grad(p) ** 2).sum()) for p in m.parameters())))
    assert min(norms) < 0.5 < max(norms)  # the case covers both sides of C
    grads, loss = private_grads(model, [cross_entropy], PrivateStep(0.0, 0.5, Q, EXPECTED,
                                                                    torch.Generator().manual_seed(0), ledger()), batch)
    for got, want in zip(grads, ref, strict=True):
        assert got.dtype == torch.float64
        assert torch.allclose(got, want, rtol=0, atol=1e-10)
    # The reported loss is the batch's plain mean cross-entropy, before the step.
    assert loss == pytest.approx(float(F.cross_entropy(tiny_model()(batch.x), batch.y).detach()), abs=1e-12)


def test_large_c_gives_the_plain_gradient_times_size_over_expected_batch() -> None:
    """No example clipped, σ = 0: Σ g_i / qN = (5/4)·(mean gradient)."""
    model, batch = tiny_model(), five()
    plain = copy.deepcopy(model)
    F.cross_entropy(plain(batch.x), batch.y).backward()
    grads, _ = private_grads(model, [cross_entropy], PrivateStep(0.0, 1e6, Q, EXPECTED,
                                                                 torch.Generator().manual_seed(0), ledger()), batch)
    for got, p in zip(grads, plain.parameters(), strict=True):
        assert torch.allclose(got, grad(p) * 5 / EXPECTED, rtol=0, atol=1e-12)


def test_noise_adds_to_the_clipped_sum() -> None:
    """σ > 0: the gradient minus the σ = 0 one is the generator's N(0, σ²C²) draw over qN, in parameter order."""
    batch = five()
    clean, _ = private_grads(tiny_model(), [cross_entropy],
                             PrivateStep(0.0, 0.5, Q, EXPECTED, torch.Generator().manual_seed(0), ledger()), batch)
    noisy, _ = private_grads(tiny_model(), [cross_entropy],
                             PrivateStep(2.0, 0.5, Q, EXPECTED, torch.Generator().manual_seed(3), ledger()), batch)
    gen = torch.Generator().manual_seed(3)
    for c, n in zip(clean, noisy, strict=True):
        draw = torch.normal(0.0, 2.0 * 0.5, size=c.shape, generator=gen)
        assert torch.allclose(n - c, draw.double() / EXPECTED, rtol=0, atol=1e-12)


def test_data_free_term_is_added_unclipped_after_privatisation() -> None:
    """A proximal penalty ½‖W − W₀‖²·10 marked data_free: p.grad = privatised gradient + its gradient, bit for bit
    the privatised one of the run without it plus 10·(W − W₀) (none on the bias), although that is far above C."""
    batch = five()
    ref_w = torch.zeros(3, 4, dtype=torch.float64)
    base, base_loss = private_grads(tiny_model(), [cross_entropy],
                                    PrivateStep(1.5, 0.5, Q, EXPECTED, torch.Generator().manual_seed(4), ledger()),
                                    batch)
    model = tiny_model()
    w0 = weight(model).detach().clone()
    prox = data_free(lambda b, o: 5.0 * ((weight(model) - ref_w) ** 2).sum())
    grads, loss = private_grads(model, [cross_entropy, prox],
                                PrivateStep(1.5, 0.5, Q, EXPECTED, torch.Generator().manual_seed(4), ledger()), batch)
    assert float((10 * (w0 - ref_w)).norm()) > 10 * 0.5  # far beyond what clipping would let through
    assert torch.equal(grads[0], base[0] + 10 * (w0 - ref_w))
    assert torch.equal(grads[1], base[1])
    assert loss == pytest.approx(base_loss + float(5.0 * (w0**2).sum()), abs=1e-12)


def test_a_term_on_a_parameter_outside_its_forward_is_refused() -> None:
    """``model[0].weight.sum()`` given to every example, not marked data_free: its gradient is no sum of
    per-example gradients, and the decomposition check stops the step (naming the parameter) instead of releasing
    it unclipped."""
    model = tiny_model()
    term = PerExample(lambda b, o: weight(model).sum().expand(b.y.shape[0]))
    with pytest.raises(PrivacyError, match=r"parameter '0\.weight'.*do not add up"):
        private_grads(model, [cross_entropy, term],
                      PrivateStep(1.0, 1.0, Q, EXPECTED, torch.Generator().manual_seed(0), ledger()), five())


def test_a_term_without_a_per_example_form_is_refused_naming_it() -> None:
    """A plain scalar term (a batch mean) under DP-SGD: one line naming it, before any gradient is taken."""
    def batch_mean_square(b: Batch, o: Forward) -> torch.Tensor:
        return o.logits.mean() ** 2

    model = tiny_model()
    step = PrivateStep(1.0, 1.0, Q, EXPECTED, torch.Generator().manual_seed(0), ledger())
    with pytest.raises(PrivacyError, match=r"loss term '.*batch_mean_square' has no per-example form.*mark it "
                                           r"data_free or give it a per-example form") as err:
        private_grads(model, [cross_entropy, batch_mean_square], step, five())
    assert "\n" not in str(err.value)
    assert weight(model).grad is None
    # A per-example form of the wrong shape (one value for the batch) is refused too.
    with pytest.raises(PrivacyError, match=r"gave per-example values of shape \(\) on a batch of 5"):
        private_grads(model, [PerExample(lambda b, o: o.logits.mean())], step, five())


def test_a_parameter_outside_the_model_in_the_optimiser_is_refused() -> None:
    """A parameter the optimiser steps but no module's forward uses: Opacus gives it no per-example gradient."""
    model = tiny_model()
    extra = nn.Parameter(torch.ones(3, dtype=torch.float64))
    opt = torch.optim.SGD([*model.parameters(), extra], lr=0.1)
    step = PrivateStep(1.0, 1.0, Q, EXPECTED, torch.Generator().manual_seed(0), ledger())
    term = PerExample(lambda b, o: cross_entropy.per_example(b, o) + (o.logits * extra).sum(1))
    b = five()
    with pytest.raises(PrivacyError, match="did not split by example"):
        fit([Objective(model, opt, [term])], [Batch(b.x, b.y, private=step)])


def test_each_batch_is_one_release_of_sigma_over_root_k_for_k_objectives() -> None:
    """Two objectives stepped on one sample: one release with noise multiplier σ/√2; a kept objective (Ditto's
    personal model) steps on the plain gradient and is not accounted; an empty sample is noise alone, accounted."""
    led = ledger()
    step = PrivateStep(1.2, 1.0, Q, EXPECTED, torch.Generator().manual_seed(0), led)
    a, b, kept = tiny_model(0), tiny_model(1), tiny_model(2)
    kept_ref = copy.deepcopy(kept)
    seen: list[torch.Tensor] = []
    objectives = [Objective(m, torch.optim.SGD(m.parameters(), lr=0.1)) for m in (a, b)]
    objectives.append(Objective(kept, torch.optim.SGD(kept.parameters(), lr=0.1), kept=True,
                                before_step=lambda: seen.append(grad(weight(kept)).clone())))
    batch = five()
    fit(objectives, [Batch(batch.x, batch.y, private=step)])
    assert led.pending == [Release(Q, 1.2 * sigma_multiple(2), 1)]
    assert sigma_multiple(2) == 1 / math.sqrt(2)
    F.cross_entropy(kept_ref(batch.x), batch.y).backward()
    assert torch.equal(seen[0], grad(weight(kept_ref)))
    # Only kept objectives: nothing is released, nothing recorded.
    led2 = ledger()
    step2 = PrivateStep(1.2, 1.0, Q, EXPECTED, torch.Generator().manual_seed(0), led2)
    fit([Objective(kept, torch.optim.SGD(kept.parameters(), lr=0.1), kept=True)],
        [Batch(batch.x, batch.y, private=step2)])
    assert led2.pending == []
    # An empty Poisson sample: a step of pure noise, loss 0, one release.
    led3 = ledger()
    step3 = PrivateStep(1.2, 1.0, Q, EXPECTED, torch.Generator().manual_seed(0), led3)
    grads, loss = private_grads(tiny_model(), [cross_entropy], step3, Batch(batch.x[:0], batch.y[:0]))
    gen = torch.Generator().manual_seed(0)
    assert loss == 0.0 and led3.pending == [Release(Q, 1.2, 1)]
    for g in grads:
        assert torch.allclose(g, torch.normal(0.0, 1.2, size=g.shape, generator=gen).double() / EXPECTED, atol=1e-12)


# ---------------------------------------------------------------------------------------------- Poisson batches
def indexed(n: int) -> DeviceData:
    """x[i] = (i, i), y[i] = i mod 10: a batch's rows say which examples it holds."""
    idx = torch.arange(n, dtype=torch.float32)
    return DeviceData(torch.stack([idx, idx], 1), torch.arange(n) % 10)


def poisson(seed: int, n: int = 1000, q: float = 0.05) -> tuple[PrivateData, PrivateStep]:
    step = PrivateStep(1.0, 1.0, q, q * n, torch.Generator().manual_seed(seed), ledger())
    return PrivateData(indexed(n), step), step


def test_poisson_batches_have_mean_size_qn_and_are_marked_private() -> None:
    n, q, steps = 1000, 0.05, 400
    data, step = poisson(0, n, q)
    sizes, hits = [], np.zeros(n)
    for batch in data.poisson_batches(steps):
        assert batch.private is step
        rows = batch.x[:, 0].long()
        assert len(set(rows.tolist())) == len(rows)  # without replacement
        assert torch.equal(batch.y, rows % 10)
        sizes.append(len(rows))
        hits[rows.numpy()] += 1
    assert len(sizes) == steps
    # Mean of `steps` Binomial(N, q) sizes: standard error √(Nq(1−q)/steps) ≈ 0.34; sizes vary (not fixed at qN).
    assert abs(np.mean(sizes) - q * n) < 5 * math.sqrt(n * q * (1 - q) / steps)
    assert np.var(sizes) == pytest.approx(n * q * (1 - q), rel=0.35)
    # Every example's inclusion rate is q: total over examples of Binomial(steps, q) counts.
    assert abs(hits.mean() / steps - q) < 5 * math.sqrt(q * (1 - q) / (steps * n))


def test_poisson_batches_repeat_from_the_generator_seed() -> None:
    def rows(seed: int) -> list[list[int]]:
        data, _ = poisson(seed)
        return [b.x[:, 0].long().tolist() for b in data.poisson_batches(20)]

    assert rows(3) == rows(3)
    assert rows(3) != rows(4)


def test_training_draws_go_through_poisson_sampling_under_dp() -> None:
    """``epoch_batches`` takes steps_per_round's number of Poisson samples (2 epochs of ⌈1000/64⌉ = 32 steps, or
    local_steps); ``sampled_batches`` its ``steps``; all marked private."""
    data, step = poisson(1)
    rng = np.random.default_rng(0)
    cfg = TrainConfig(local_epochs=2, batch_size=64)
    assert steps_per_round(1000, cfg) == 32
    batches = list(epoch_batches(data, cfg, rng))
    assert len(batches) == 32 and all(b.private is step for b in batches)
    assert len(list(epoch_batches(data, TrainConfig(local_steps=7, batch_size=64), rng))) == 7
    drawn = list(sampled_batches(data, 64, 5, rng))
    assert len(drawn) == 5 and all(b.private is step for b in drawn)
    # The wrapped set's own reads are not privatised.
    assert data.take(np.arange(3)).private is None
    assert len(data) == 1000 and torch.equal(data.y, indexed(1000).y)


# ---------------------------------------------------------------------------------------------- prepare_model
def with_batchnorm() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict(conv=nn.Conv2d(1, 4, 3), norm_layer=nn.BatchNorm2d(4),
                                     act=nn.ReLU(inplace=True), flat=nn.Flatten(), fc=nn.Linear(4 * 6 * 6, 3)))


def test_batchnorm_is_refused_in_one_line_naming_the_layer() -> None:
    with pytest.raises(PrivacyError, match=r"org's model has BatchNorm \(norm_layer\)") as err:
        prepare_model(with_batchnorm(), PrivacyConfig(noise_multiplier=1.0, batchnorm="refuse"), "org")
    assert "\n" not in str(err.value)


def test_batchnorm_is_replaced_by_groupnorm_and_the_model_steps_under_dp() -> None:
    model = prepare_model(with_batchnorm(), PrivacyConfig(noise_multiplier=1.0), "org")
    kinds = {type(m) for m in model.modules()}
    assert nn.GroupNorm in kinds and not any(issubclass(k, nn.modules.batchnorm._BatchNorm) for k in kinds)
    assert all(not getattr(m, "inplace", False) for m in model.modules())  # in-place ReLU made out-of-place
    led = ledger()
    step = PrivateStep(1.0, 1.0, 0.1, 6.0, torch.Generator().manual_seed(0), led)
    x = torch.randn(6, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    fit([Objective(model, torch.optim.SGD(model.parameters(), lr=0.1))], [Batch(x, torch.arange(6) % 3, private=step)])
    assert led.pending == [Release(0.1, 1.0, 1)]


def test_a_layer_opacus_cannot_serve_is_refused() -> None:
    with pytest.raises(PrivacyError, match=r"cannot be trained with DP-SGD: .*LSTM"):
        prepare_model(nn.Sequential(nn.LSTM(3, 3)), PrivacyConfig(noise_multiplier=1.0), "org")


def rmnist() -> nn.Module:
    return build_model("rmnist_cnn", (1, 28, 28), 10, latent_dim=None, bounded_latent=False)


def test_rmnist_cnn_takes_a_dp_sgd_step_after_prepare_model() -> None:
    """rmnist_cnn is built channels-last with BatchNorm: after prepare_model its convolutions' per-example
    gradients add up (the decomposition check passes) and a full step through ``fit`` changes every weight."""
    model = prepare_model(rmnist(), PrivacyConfig(noise_multiplier=1.0), "org")
    assert all(p.is_contiguous() for p in model.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    led = ledger()
    step = PrivateStep(1.0, 1.0, 0.01, 8.0, torch.Generator().manual_seed(0), led)
    g = torch.Generator().manual_seed(0)
    batch = Batch(torch.rand(8, 1, 28, 28, generator=g), torch.arange(8) % 10, private=step)
    result = fit([Objective(model, torch.optim.SGD(model.parameters(), lr=0.05))], [batch])
    assert math.isfinite(result.loss) and result.steps == 1
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    assert led.pending == [Release(0.01, 1.0, 1)]


def test_rmnist_cnn_left_channels_last_is_caught_by_the_decomposition_check() -> None:
    """The failure prepare_model's contiguous_format prevents: BatchNorm replaced but convolution weights left
    channels-last, Opacus' per-example gradients of a convolution do not add up, and the step is refused."""
    from opacus.validators import ModuleValidator

    model = ModuleValidator.fix(rmnist())
    assert any(p.dim() == 4 and not p.is_contiguous() for p in model.parameters())
    step = PrivateStep(1.0, 1.0, 0.01, 8.0, torch.Generator().manual_seed(0), ledger())
    g = torch.Generator().manual_seed(0)
    batch = Batch(torch.rand(8, 1, 28, 28, generator=g), torch.arange(8) % 10, private=step)
    with pytest.raises(PrivacyError, match=r"'encoder\.\d\.weight'.*do not add up"):
        fit([Objective(model, torch.optim.SGD(model.parameters(), lr=0.05))], [batch])


# ---------------------------------------------------------------------------------------------- empty samples
def test_a_kept_objective_takes_no_step_on_an_empty_poisson_sample() -> None:
    """Ditto's personal model beside a private one: on an empty sample it is not stepped (a mean over no example
    is NaN), and its loss is the mean over the samples it stepped on; the private objective steps on both."""
    led = ledger()
    step = PrivateStep(0.0, 1.0, Q, EXPECTED, torch.Generator().manual_seed(0), led)
    private, kept = tiny_model(0), tiny_model(1)
    ref = copy.deepcopy(kept)
    b = five()
    batches = [Batch(b.x, b.y, private=step), Batch(b.x[:0], b.y[:0], private=step)]
    result = fit([Objective(private, torch.optim.SGD(private.parameters(), lr=0.1)),
                  Objective(kept, torch.optim.SGD(kept.parameters(), lr=0.1), kept=True)], batches)
    plain = F.cross_entropy(ref(b.x), b.y)
    assert result.losses[1] == pytest.approx(float(plain.detach()), abs=1e-12)
    plain.backward()
    assert torch.allclose(weight(kept), weight(ref) - 0.1 * grad(weight(ref)), rtol=0, atol=1e-12)
    assert result.steps == 2 and led.pending == [Release(Q, 0.0, 2)]


def test_data_free_terms_step_on_an_empty_poisson_sample_too() -> None:
    """An empty sample: the privatised gradient is the noise alone (σ = 0 here), the proximal term's is added as
    on any other sample, and the reported loss is its value."""
    model = tiny_model()
    w0 = weight(model).detach().clone()
    prox = data_free(lambda b, o: 5.0 * (weight(model) ** 2).sum())
    step = PrivateStep(0.0, 1.0, Q, EXPECTED, torch.Generator().manual_seed(0), ledger())
    b = five()
    grads, loss = private_grads(model, [cross_entropy, prox], step, Batch(b.x[:0], b.y[:0]))
    assert torch.equal(grads[0], 10 * w0)
    assert torch.equal(grads[1], torch.zeros(3, dtype=torch.float64))
    assert loss == pytest.approx(float(5.0 * (w0**2).sum()), abs=1e-12)


# ---------------------------------------------------------------------------------------------- buffers
class RunningMean(nn.Module):
    """A linear layer with a float buffer: the running mean of its inputs in training (when ``tracks``), and a
    constant scale."""

    running_mean: torch.Tensor
    scale: torch.Tensor
    seen: torch.Tensor

    def __init__(self, tracks: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 3).double()
        self.tracks = tracks
        self.register_buffer("running_mean", torch.zeros(4, dtype=torch.float64))
        self.register_buffer("scale", torch.ones(4, dtype=torch.float64))
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.seen += 1  # an integer count of steps: no example's values in it
                if self.tracks:
                    self.running_mean.mul_(0.9).add_(0.1 * x.mean(0))
        return cast(torch.Tensor, self.lin(x * self.scale))


def test_a_float_buffer_a_private_step_changes_is_refused_naming_it() -> None:
    """The running mean would leave with the model without clipping or noise: one line naming it. A constant
    float buffer and an integer count are fine; without DP the same model trains."""
    b = five()
    tracking = RunningMean(tracks=True)
    step = PrivateStep(1.0, 1.0, Q, EXPECTED, torch.Generator().manual_seed(0), ledger())
    with pytest.raises(PrivacyError, match=r"buffer 'running_mean' changed in a private step: a buffer a private "
                                           r"step changes would leave unnoised") as err:
        fit([Objective(tracking, torch.optim.SGD(tracking.parameters(), lr=0.1))], [Batch(b.x, b.y, private=step)])
    assert "\n" not in str(err.value)
    still = RunningMean(tracks=False)
    led = ledger()
    step = PrivateStep(1.0, 1.0, Q, EXPECTED, torch.Generator().manual_seed(0), led)
    fit([Objective(still, torch.optim.SGD(still.parameters(), lr=0.1))], [Batch(b.x, b.y, private=step)])
    assert int(still.seen) == 1 and led.pending == [Release(Q, 1.0, 1)]
    plain = RunningMean(tracks=True)
    fit([Objective(plain, torch.optim.SGD(plain.parameters(), lr=0.1))], [Batch(b.x, b.y)])
    assert torch.allclose(plain.running_mean, 0.1 * b.x.mean(0), rtol=0, atol=1e-15)
