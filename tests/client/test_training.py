"""The one training loop: objectives stepped in order on every batch, gradient hooks, eval mode, batch draws."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from hetfed.client.training import (
    Batch,
    DeviceData,
    Forward,
    Objective,
    TrainingDivergedError,
    cross_entropy,
    epoch_batches,
    eval_mode,
    evaluate,
    fit,
    make_optimizer,
    round_lr_factor,
    sampled_batches,
)
from hetfed.wire.specs import TrainConfig


def data(n: int = 6) -> DeviceData:
    g = torch.Generator().manual_seed(0)
    return DeviceData(torch.randn(n, 3, generator=g, dtype=torch.float64), torch.arange(n) % 2)


def linear(weight: float) -> nn.Linear:
    m = nn.Linear(3, 2, bias=False).double()
    with torch.no_grad():
        m.weight.fill_(weight)
    return m


def test_two_objectives_step_in_order_on_the_same_batch() -> None:
    """A global and a personal model on one batch: each gets exactly its own plain SGD step, in order."""
    d = data()
    a, b = linear(0.1), linear(-0.2)
    seen: list[str] = []

    def marker(name: str):  # type: ignore[no-untyped-def]
        def term(batch: Batch, out: Forward) -> torch.Tensor:
            seen.append(name)
            return out.logits.sum() * 0.0
        return term

    opt_a = torch.optim.SGD(a.parameters(), lr=0.5)
    opt_b = torch.optim.SGD(b.parameters(), lr=0.5)
    batch = Batch(d.x, d.y)
    ref_a, ref_b = linear(0.1), linear(-0.2)
    result = fit([Objective(a, opt_a, [cross_entropy, marker("a")]), Objective(b, opt_b, [cross_entropy, marker("b")])],
                 [batch])
    assert seen == ["a", "b"] and result.steps == 1 and len(result.losses) == 2
    # The same step by hand, in float64.
    for model, ref in ((a, ref_a), (b, ref_b)):
        loss = nn.functional.cross_entropy(ref(batch.x), batch.y)
        loss.backward()
        with torch.no_grad():
            want = ref.weight - 0.5 * ref.weight.grad
        torch.testing.assert_close(model.weight, want, rtol=0, atol=1e-15)
    with torch.no_grad():  # the loss recorded is the one the step was taken on (before it)
        assert result.loss == pytest.approx(float(nn.functional.cross_entropy(ref_a(batch.x), batch.y)), abs=0)


def test_before_step_sees_and_changes_the_gradient() -> None:
    d = data()
    m = linear(0.3)
    before = m.weight.detach().clone()

    def zero_first_row() -> None:
        assert m.weight.grad is not None
        m.weight.grad[0].zero_()

    fit([Objective(m, torch.optim.SGD(m.parameters(), lr=1.0), before_step=zero_first_row)], [Batch(d.x, d.y)])
    torch.testing.assert_close(m.weight[0], before[0])  # no step where the hook zeroed the gradient
    assert not torch.equal(m.weight[1], before[1])


def test_a_custom_forward_feeds_every_term() -> None:
    d = data()
    m = linear(0.1)

    def forward(model: nn.Module, batch: Batch) -> Forward:
        logits = model(batch.x)
        return Forward(logits, {"z": logits * 2})

    got: list[torch.Tensor] = []
    fit([Objective(m, torch.optim.SGD(m.parameters(), lr=0.0), [cross_entropy, lambda b, o: got.append(o["z"]) or
                                                                 o["z"].sum() * 0], forward)], [Batch(d.x, d.y)])
    assert len(got) == 1 and got[0].shape == (6, 2)
    with pytest.raises(KeyError, match="produced no 'mu'"):
        Forward(torch.zeros(1))["mu"]


def test_epoch_batches_cover_each_epoch_once_or_take_exactly_the_steps() -> None:
    d = DeviceData(torch.arange(10.0)[:, None], torch.arange(10))
    epochs = list(epoch_batches(d, TrainConfig(local_epochs=2, batch_size=4), np.random.default_rng(0)))
    assert [len(b.y) for b in epochs] == [4, 4, 2, 4, 4, 2]
    assert sorted(torch.cat([b.y for b in epochs[:3]]).tolist()) == list(range(10))
    steps = list(epoch_batches(d, TrainConfig(local_steps=7, batch_size=4), np.random.default_rng(0)))
    assert len(steps) == 7
    again = list(epoch_batches(d, TrainConfig(local_steps=7, batch_size=4), np.random.default_rng(0)))
    assert all(torch.equal(a.y, b.y) for a, b in zip(steps, again, strict=True))  # seeded
    # Each epoch is one seeded permutation, cut in order: the draws of the seed's generator, epoch after epoch.
    rng = np.random.default_rng(0)
    want = [p[s:s + 4] for p in (rng.permutation(10), rng.permutation(10)) for s in range(0, 10, 4)]
    assert [b.y.tolist() for b in epochs] == [w.tolist() for w in want]


def test_fit_reports_the_mean_of_the_step_losses_exactly_as_python_sums_them() -> None:
    # The losses are summed on the device in float64 and read once: the same value, bit for bit, as reading
    # each step's float32 loss into a Python float and summing those.
    g = torch.Generator().manual_seed(3)
    d = DeviceData(torch.randn(50, 3, generator=g), torch.randint(0, 2, (50,), generator=g))
    cfg = TrainConfig(local_epochs=3, batch_size=8)
    m, ref = nn.Linear(3, 2), nn.Linear(3, 2)
    ref.load_state_dict(m.state_dict())
    result = fit([Objective(m, torch.optim.SGD(m.parameters(), lr=0.3))], epoch_batches(d, cfg, np.random.default_rng(5)))
    opt, total, steps = torch.optim.SGD(ref.parameters(), lr=0.3), 0.0, 0
    for batch in epoch_batches(d, cfg, np.random.default_rng(5)):
        loss = nn.functional.cross_entropy(ref(batch.x), batch.y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        total += float(loss.detach())
        steps += 1
    assert result.steps == steps == 21
    assert result.loss == total / steps  # exact
    assert isinstance(result.loss, float)


def huge(n_in: int = 3) -> nn.Module:
    """Two layers with weights of 1e20: the logits (about 1e41) overflow float32 at the first step."""
    m = nn.Sequential(nn.Linear(n_in, 8), nn.Linear(8, 2))
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(1e20)
    return m


def test_fit_refuses_a_round_whose_loss_overflowed_and_names_the_steps_and_rate() -> None:
    # The loss is NaN or infinite: fit raises instead of returning a model nothing may be made from.
    g = torch.Generator().manual_seed(3)
    d = DeviceData(torch.randn(16, 3, generator=g), torch.randint(0, 2, (16,), generator=g))
    cfg = TrainConfig(local_epochs=1, batch_size=8)
    m = huge()
    with pytest.raises(TrainingDivergedError, match=r"^the mean training loss is (nan|inf) over 2 steps at lr 0.05$"):
        fit([Objective(m, torch.optim.SGD(m.parameters(), lr=0.05))], epoch_batches(d, cfg, np.random.default_rng(0)))
    # With two objectives the message names the one that diverged; a finite one alone does not raise.
    ok, bad = nn.Linear(3, 2), huge()
    assert math.isfinite(fit([Objective(ok, torch.optim.SGD(ok.parameters(), lr=0.1))],
                             epoch_batches(d, cfg, np.random.default_rng(0))).loss)
    with pytest.raises(TrainingDivergedError, match=r"^objective 2 of 2: the mean training loss is (nan|inf) over 2 steps"):
        fit([Objective(ok, torch.optim.SGD(ok.parameters(), lr=0.1)),
             Objective(bad, torch.optim.SGD(bad.parameters(), lr=1.0))], epoch_batches(d, cfg, np.random.default_rng(0)))


def test_sampled_batches_draw_without_replacement_within_a_batch() -> None:
    d = DeviceData(torch.arange(10.0)[:, None], torch.arange(10))
    batches = list(sampled_batches(d, 4, 5, np.random.default_rng(1)))
    assert len(batches) == 5 and all(len(set(b.y.tolist())) == 4 for b in batches)


def test_eval_mode_restores_each_models_mode_even_on_error() -> None:
    a, b = nn.Dropout(), nn.Dropout()
    b.eval()
    with eval_mode(a, b):
        assert not a.training and not b.training
    assert a.training and not b.training
    with pytest.raises(RuntimeError), eval_mode(a):
        raise RuntimeError("boom")
    assert a.training


def test_evaluate_with_a_custom_prediction() -> None:
    d = DeviceData(torch.zeros(4, 3), torch.tensor([0, 1, 1, 1]))
    m = nn.Linear(3, 2)
    # Always predicts class 1 with probability 3/4.
    probs = torch.tensor([0.25, 0.75]).log()
    acc, loss = evaluate(m, d, predict=lambda x: probs.expand(len(x), 2))
    assert acc == 0.75
    assert loss == pytest.approx((-np.log(0.25) - 3 * np.log(0.75)) / 4, rel=1e-6)


def test_the_round_factor_is_fedgens_exponential_decay_by_hand() -> None:
    """FedGen steps ExponentialLR(0.99) with the round index after each round: 0-based round g trains at
    lr·0.99^max(g − 1, 0), so 1-based rounds 1, 2, 3, 4 at lr, lr, 0.99·lr, 0.9801·lr (lr_decay_from = 3)."""
    fedgen = TrainConfig(lr=0.01, lr_decay=0.99, lr_decay_from=3)
    assert [fedgen.lr_factor(t) for t in (1, 2, 3, 4)] == [1.0, 1.0, 0.99, 0.99 ** 2]
    every_round = TrainConfig(lr_decay=0.5)  # the default start: round 2 takes the first decayed rate
    assert [every_round.lr_factor(t) for t in (1, 2, 3)] == [1.0, 0.5, 0.25]
    assert TrainConfig().lr_factor(200) == 1.0
    for bad in ({"lr_decay": 0.0}, {"lr_decay": 1.5}, {"lr_decay_from": 0}):
        with pytest.raises(ValueError, match="lr_decay"):
            TrainConfig(**bad)  # type: ignore[arg-type]


def test_fit_steps_every_optimiser_of_the_config_at_its_base_rate_times_the_rounds_factor() -> None:
    """One plain SGD step at lr 0.5 under a factor of 0.25 moves the weight by 0.125·grad, exactly; an optimiser
    built elsewhere (no base rate) keeps its own rate; outside the block the base rate is back."""
    d = data()
    batch = Batch(d.x, d.y)
    model, ref, other = linear(0.1), linear(0.1), linear(0.3)
    opt = make_optimizer(list(model.parameters()), TrainConfig(lr=0.5))
    own = torch.optim.SGD(other.parameters(), lr=0.5)
    with round_lr_factor(0.25):
        fit([Objective(model, opt), Objective(other, own)], [batch])
    assert opt.param_groups[0]["lr"] == 0.125 and own.param_groups[0]["lr"] == 0.5
    loss = nn.functional.cross_entropy(ref(batch.x), batch.y)
    loss.backward()
    with torch.no_grad():
        torch.testing.assert_close(model.weight, ref.weight - 0.125 * ref.weight.grad, rtol=0, atol=1e-15)
    fit([Objective(model, opt)], [])
    assert opt.param_groups[0]["lr"] == 0.5


def two_layers() -> nn.Sequential:
    """A float64 net of two layers with fixed weights (a gradient over two parameter tensors and a bias)."""
    m = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2, bias=False)).double()
    with torch.no_grad():
        for k, p in enumerate(m.parameters()):
            p.copy_(torch.linspace(-1.0, 1.0, p.numel(), dtype=torch.float64).reshape(p.shape) * (k + 1))
    return m


def test_a_gradient_cap_scales_the_step_to_the_cap_over_every_parameter_together() -> None:
    """max_grad_norm: one plain SGD step at lr 0.5 on the gradient scaled by cap / ||g|| (the norm over all three
    tensors together), by hand in float64; a cap above ||g|| and no cap take the plain step."""
    d = data()
    batch = Batch(d.x, d.y)
    ref = two_layers()
    nn.functional.cross_entropy(ref(batch.x), batch.y).backward()
    grads = [p.grad.detach().clone() for p in ref.parameters()]  # type: ignore[union-attr]
    norm = math.sqrt(sum(float((g * g).sum()) for g in grads))
    assert norm > 0.1  # the cap below binds
    for cap, scale in ((0.1, 0.1 / norm), (norm * 2, 1.0), (0.0, 1.0)):
        m = two_layers()
        fit([Objective(m, make_optimizer(list(m.parameters()), TrainConfig(lr=0.5, max_grad_norm=cap)))], [batch])
        with torch.no_grad():
            for p, p0, g in zip(m.parameters(), ref.parameters(), grads, strict=True):
                # torch divides by ||g|| + 1e-6: relative 1e-6 / ||g|| from the exact scale
                torch.testing.assert_close(p, p0 - 0.5 * scale * g, rtol=0, atol=1e-6)
        step = math.sqrt(sum(float(((p0 - p).detach() ** 2).sum()) for p, p0 in zip(m.parameters(), ref.parameters(),
                                                                                    strict=True)))
        assert step == pytest.approx(0.5 * min(norm, cap or norm), rel=1e-5)


def test_the_cap_applies_to_the_configs_optimisers_after_before_step_and_is_checked() -> None:
    d = data()
    batch = Batch(d.x, d.y)
    # An optimiser built elsewhere has no cap: its step is the plain one.
    m, ref = linear(0.1), linear(0.1)
    fit([Objective(m, torch.optim.SGD(m.parameters(), lr=0.5))], [batch])
    nn.functional.cross_entropy(ref(batch.x), batch.y).backward()
    with torch.no_grad():
        torch.testing.assert_close(m.weight, ref.weight - 0.5 * ref.weight.grad, rtol=0, atol=1e-15)
    # The cap sees the gradient before_step left: a hook that scales it by 1000 is capped back to the cap.
    m = linear(0.1)
    before = m.weight.detach().clone()

    def inflate() -> None:
        assert m.weight.grad is not None
        m.weight.grad.mul_(1000.0)

    fit([Objective(m, make_optimizer([m.weight], TrainConfig(lr=1.0, max_grad_norm=0.25)), before_step=inflate)],
        [batch])
    assert float((m.weight.detach() - before).norm()) == pytest.approx(0.25, rel=1e-5)
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="max_grad_norm must be a finite number >= 0"):
            TrainConfig(max_grad_norm=bad)
