"""Client-side units: config validation, backoff, the proximal term, every spec having a client half."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from hetfed.client.algorithms import ClientHalf, client_half_type
from hetfed.client.config import load_client_config
from hetfed.client.losses import ProximalTerm
from hetfed.client.runtime import backoff_delays
from hetfed.wire.config import ConfigError
from hetfed.wire.specs import SPECS


def test_misspelled_field_is_named(tmp_path: Path) -> None:
    p = tmp_path / "client.toml"
    p.write_text('organization = "a"\nrun = "r"\n[data]\ndatset = "digits"\n')
    with pytest.raises(ConfigError, match=r"client.toml.data: unknown field 'datset' \(did you mean 'dataset'\?\)"):
        load_client_config(p)


def test_bad_values_are_named(tmp_path: Path) -> None:
    p = tmp_path / "client.toml"
    p.write_text('organization = "a"\nrun = "r"\ndevice = "tpu"\n')
    with pytest.raises(ConfigError, match="device must be auto, cpu, cuda or cuda:N"):
        load_client_config(p)
    p.write_text('organization = "a"\nrun = "r"\n[retry]\nmultiplier = "fast"\n')
    with pytest.raises(ConfigError, match=r"retry.multiplier: expected a number, got 'fast'"):
        load_client_config(p)
    p.write_text('run = "r"\n')
    with pytest.raises(ConfigError, match="missing required field 'organization'"):
        load_client_config(p)


def test_valid_client_config(tmp_path: Path) -> None:
    p = tmp_path / "client.toml"
    p.write_text('organization = "a"\nrun = "r"\naggregator = "agg:50051"\n[model]\nname = "mlp"\nlatent_dim = 16\n'
                 '[data]\ndataset = "digits"\npartition = "iid"\nnum_clients = 2\nclient_index = 1\n')
    cfg = load_client_config(p)
    assert (cfg.model.name, cfg.model.latent_dim, cfg.data.client_index) == ("mlp", 16, 1)


def test_backoff_is_capped_full_jitter() -> None:
    delays = backoff_delays(0.5, 4.0, 2.0, random.Random(3))
    caps = [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    got = [next(delays) for _ in caps]
    assert all(0 <= d <= c for d, c in zip(got, caps, strict=True))
    again = backoff_delays(0.5, 4.0, 2.0, random.Random(3))
    assert [next(again) for _ in caps] == got  # seeded: deterministic


def test_proximal_term_matches_hand_computation() -> None:
    ref = [torch.tensor([1.0, 2.0]), torch.tensor([[0.0, -1.0]])]
    params = [torch.tensor([2.0, 0.0], requires_grad=True), torch.tensor([[1.0, 1.0]], requires_grad=True)]
    term = ProximalTerm(0.1, ref)
    value = term(params)
    # ||(1, -2)||² + ||(1, 2)||² = 5 + 5 = 10; (0.1 / 2) · 10 = 0.5
    assert float(value.detach()) == pytest.approx(0.5, abs=1e-7)
    value.backward()
    # d/dw (mu/2)||w - r||² = mu (w - r)
    torch.testing.assert_close(params[0].grad, torch.tensor([0.1, -0.2]))
    torch.testing.assert_close(params[1].grad, torch.tensor([[0.1, 0.2]]))


def test_every_spec_has_a_client_half() -> None:
    for spec in SPECS.values():
        assert issubclass(client_half_type(spec), ClientHalf), spec.name


def test_the_round_loop_evaluates_every_n_rounds_from_the_first() -> None:
    from hetfed.client.runtime import evaluation_due

    assert [r for r in range(1, 8) if evaluation_due(r, 3)] == [1, 4, 7]
    assert all(evaluation_due(r, 1) for r in range(1, 5))


def test_the_round_loop_trains_each_round_at_the_configs_scheduled_rate() -> None:
    """A kept SGD optimiser (FedAvg, keep_optimizer_state) steps round t at lr·γ^max(t − 2, 0) under
    lr_decay_from = 3 (FedGen's schedule): the round loop sets the factor, the half knows nothing of it."""
    from hetfed.client.algorithms import ClientContext
    from hetfed.client.data import DataConfig, load_client_data
    from hetfed.client.runtime import run_round
    from hetfed.wire.payloads import Received
    from hetfed.wire.phases import Action

    spec = SPECS["fedavg"]
    config = spec.config(batch_size=16, local_steps=1, lr=0.01, momentum=0.9, keep_optimizer_state=True,
                         lr_decay=0.99, lr_decay_from=3)
    data = load_client_data(DataConfig(dataset="digits", partition="iid", num_clients=2, client_index=0))
    half_type = client_half_type(spec)
    model = half_type.make_model("mlp", data.input_shape, data.num_classes, seed=5, latent_dim=None,
                                 bounded_latent=False, config=config)
    half = half_type(ClientContext("org-0", model, data, torch.device("cpu"), config, 5))
    rates = []
    for t in (1, 2, 3, 4):
        run_round(half, Action.TRAIN, t, 100 + t, Received([], frozenset()))
        rates.append(half.optimizer().param_groups[0]["lr"])
    assert rates == [0.01, 0.01, 0.01 * 0.99, 0.01 * 0.99 ** 2]
