"""keep_optimizer_state is one field of every config and one mechanism of the client base: a kept optimiser is the
same object every round and comes back after a restart with its momentum; otherwise each round gets a fresh one."""

from __future__ import annotations

import pytest
import torch

from hetfed.client.algorithms import ClientContext, ClientHalf, client_half_type
from hetfed.client.data import DataConfig, load_client_data
from hetfed.wire.config import ConfigError
from hetfed.wire.payloads import Received
from hetfed.wire.phases import Phase
from hetfed.wire.specs import SPECS, get_spec

torch.set_num_threads(1)
NOTHING = Received([], frozenset())
DIGITS = DataConfig(dataset="digits", partition="iid", num_clients=2, client_index=0)


def test_every_config_has_the_field_with_its_algorithms_default_and_the_loader_checks_it() -> None:
    kept = {name for name, spec in SPECS.items() if spec.config().keep_optimizer_state}
    assert kept == {"fedcma", "fedcma_paper", "fedh2l", "fedsr", "fedl2r", "fedcmi", "simfed", "fedmd", "fml"}
    with pytest.raises(ConfigError, match=r"^config.keep_optimizer_state: expected true or false, got 'yes'$"):
        get_spec("local").parse({"keep_optimizer_state": "yes"})


def _half(name: str, **fields: object) -> ClientHalf:  # type: ignore[type-arg]
    spec = get_spec(name)
    config = spec.config(batch_size=16, local_steps=2, lr=0.05, momentum=0.9, **fields)
    data = load_client_data(DIGITS)
    half_type = client_half_type(spec)
    model = half_type.make_model("mlp", data.input_shape, data.num_classes, seed=3, latent_dim=None,
                                 bounded_latent=spec.latent_bounded(config), config=config)
    return half_type(ClientContext("org-0", model, data, torch.device("cpu"), config, 3))


def _round(name: str, half: ClientHalf) -> None:  # type: ignore[type-arg]
    if get_spec(name).first_phase is Phase.SETUP:
        half.setup(10)
    half.train(1, 11, NOTHING)


@pytest.mark.parametrize("name", ["fedcma", "fedavg_head", "local"])
def test_a_kept_optimizer_is_one_object_and_a_restarted_half_resumes_its_momentum(name: str) -> None:
    extra = {"latent_dim": 64, "num_classes": 10} if name == "fedcma" else {}
    half = _half(name, keep_optimizer_state=True, **extra)
    _round(name, half)
    opt = half.optimizer()
    assert half.optimizer() is opt
    state = half.private_state()
    buffers = [s["momentum_buffer"] for s in state["optimizer"]["state"].values()]
    assert buffers and all(b is not None and b.abs().sum() > 0 for b in buffers)
    fresh = _half(name, keep_optimizer_state=True, **extra)
    fresh.load_private_state(state)
    resumed = fresh.optimizer().state_dict()["state"]
    assert resumed.keys() == state["optimizer"]["state"].keys()
    assert all(torch.equal(resumed[k]["momentum_buffer"], v["momentum_buffer"])
               for k, v in state["optimizer"]["state"].items())


@pytest.mark.parametrize("name", ["fedcma", "fedavg_head", "local"])
def test_without_the_field_each_round_gets_a_fresh_optimizer_and_none_is_saved(name: str) -> None:
    extra = {"latent_dim": 64, "num_classes": 10} if name == "fedcma" else {}
    half = _half(name, keep_optimizer_state=False, **extra)
    _round(name, half)
    assert half.optimizer() is not half.optimizer()
    assert set(half.private_state()) == {"model", *half.private_attributes}
