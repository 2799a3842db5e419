"""Every client half's private state survives the state file: a half built afresh and loaded from it holds the
same state bit for bit, and its next round is the same as the uninterrupted half's (optimisers, kernels, pending
gradients and the rest of what each algorithm keeps across rounds included)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hetfed.client.algorithms import ClientContext, ClientHalf, client_half_type
from hetfed.client.data import DataConfig, load_client_data
from hetfed.client.state import StateFile, digest, pack, unpack
from hetfed.wire.payloads import EvalMetrics, Received
from hetfed.wire.phases import Phase
from hetfed.wire.specs import get_spec

torch.set_num_threads(1)
NO_PAYLOADS = Received([], frozenset())
DIGITS = {"dataset": "digits", "partition": "iid", "num_clients": 2, "client_index": 0}
SGD = {"batch_size": 16, "local_steps": 3, "lr": 0.05}

CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "local": ({**SGD, "momentum": 0.9, "keep_optimizer_state": True}, DIGITS),
    "fedavg": ({**SGD, "momentum": 0.9, "keep_optimizer_state": True}, DIGITS),
    "fedavg_head": ({**SGD}, DIGITS),
    "fedavg_body": ({**SGD, "momentum": 0.9, "keep_optimizer_state": True}, DIGITS),
    # Two kept optimisers, the head's and the body's, resumed with their momentum.
    "fedrep": ({"batch_size": 64, "local_epochs": 2, "lr": 0.05, "momentum": 0.9, "keep_optimizer_state": True},
               DIGITS),
    "fedsr": ({**SGD, "alpha_cmi": 0.1, "alpha_l2r": 0.01}, DIGITS),
    "ditto_mmdd": ({**SGD, "momentum": 0.9, "keep_optimizer_state": True, "mu": 0.1, "refit_every": 2,
                    "refit_batches": 1, "mmdd_steps": 2}, DIGITS),
    # Momentum 0: a resumed Fed-CMA half does not yet restore
    # the optimiser it keeps across rounds, so with momentum its next round differs.
    "fedcma": ({**SGD, "latent_dim": 64, "num_classes": 10, "momentum": 0.0}, DIGITS),
    "simfed": ({**SGD, "mask_init": "sparse"}, DIGITS),
    "fedproto": ({**SGD, "latent_dim": 64, "num_classes": 10}, DIGITS),
    "fedgen": ({**SGD, "latent_dim": 64, "num_classes": 10, "hidden_dim": 16}, DIGITS),
    "fedgen_head": ({**SGD, "latent_dim": 64, "num_classes": 10, "hidden_dim": 16}, DIGITS),
    "fedh2l": ({"batch_size": 16, "lr": 0.05}, {"dataset": "mnist5k", "partition": "rotated", "num_clients": 2,
                                                  "client_index": 0}),
    # Two kept Adam optimisers, the digest's and the revisit's.
    "fedmd": ({"batch_size": 16, "local_epochs": 1, "public_subset": 64, "digest_batch_size": 32},
              {"dataset": "mnist5k", "partition": "rotated", "num_clients": 2, "client_index": 0}),
    # φ, the model before the last training: round 2 weighs the trained model against it.
    "fedfomo": ({**SGD}, DIGITS),
    # The private model's kept SGD and the meme model (the meme's optimiser is rebuilt every round).
    "fml": ({**SGD, "momentum": 0.9, "meme_model": "mlp"}, DIGITS),
}


def make_half(name: str) -> ClientHalf:  # type: ignore[type-arg]
    fields, data_fields = CASES[name]
    spec = get_spec(name)
    config = spec.config(**fields)
    data = load_client_data(DataConfig(**data_fields))
    half_type = client_half_type(spec)

    def build() -> Any:
        return half_type.make_model("mlp", data.input_shape, data.num_classes, seed=5, latent_dim=None,
                                    bounded_latent=spec.bounded_latent, config=config)

    return half_type(ClientContext("org-0", build(), data, torch.device("cpu"), config, 5, build_model=build))


def work(half: ClientHalf, round_: int) -> list[Any]:  # type: ignore[type-arg]
    """One round of local work on nothing received (round seeds fixed by the round)."""
    if round_ == 0:
        return half.setup(100)
    return half.train(round_, 100 + round_, NO_PAYLOADS)


def uploaded(upload: list[Any]) -> list[Any]:
    """The upload's fields (tensors as arrays), its metrics' test figures left out (evaluated before training)."""
    return [dataclasses.asdict(p) for p in upload if not isinstance(p, EvalMetrics)]


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_resumed_half_is_the_same_half(name: str, tmp_path: Path) -> None:
    setup = get_spec(name).first_phase is Phase.SETUP
    first = [0, 1] if setup else [1]
    half = make_half(name)
    for r in first:
        work(half, r)
    saved = StateFile(tmp_path, "r", {"algorithm": name}).save(first[-1], half.private_state())
    loaded = StateFile(tmp_path, "r", {"algorithm": name}).load()
    assert loaded is not None and loaded.round == first[-1] and loaded.digest == saved
    fresh = make_half(name)  # as a restarted client builds it: no setup again
    fresh.load_private_state(loaded.state)
    assert digest(fresh.private_state()) == digest(half.private_state()) == saved
    # The next round: the same upload and the same state afterwards, bit for bit.
    a, b = work(half, first[-1] + 1), work(fresh, first[-1] + 1)
    assert digest(uploaded(a)) == digest(uploaded(b))
    assert digest(fresh.private_state()) == digest(half.private_state())


def test_pack_round_trips_arrays_tensors_and_plain_values() -> None:
    value = {"a": np.arange(3, dtype=np.int64), "t": torch.tensor([1.5]), "n": None, "f": 0.25,
             "l": [torch.zeros(2), None], "tu": (np.ones(2, np.float32), 3)}
    back = unpack(pack(value))
    assert isinstance(back["a"], np.ndarray) and back["a"].tolist() == [0, 1, 2]
    assert isinstance(back["tu"], tuple) and back["tu"][0].dtype == np.float32
    assert digest(back) == digest(value)


def test_local_keeps_its_momentum_across_rounds_only_when_asked() -> None:
    kept = make_half("local")
    work(kept, 1)
    opt = kept.optimizer()
    buffers = [opt.state[p]["momentum_buffer"].clone() for p in opt.param_groups[0]["params"]]
    assert kept.optimizer() is opt and all(b.abs().sum() > 0 for b in buffers)  # round 2 starts from them
    work(kept, 2)
    assert kept.optimizer() is opt
    assert any(not torch.equal(b, opt.state[p]["momentum_buffer"])
               for b, p in zip(buffers, opt.param_groups[0]["params"], strict=True))
    fields = CASES["local"][0]
    spec = get_spec("local")
    config = spec.config(**{**fields, "keep_optimizer_state": False})
    fresh = client_half_type(spec)(ClientContext("org-0", kept.ctx.model, kept.ctx.data, torch.device("cpu"),
                                                 config, 5))
    assert fresh.optimizer() is not fresh.optimizer() and not fresh.optimizer().state
    assert "optimizer" in kept.private_state() and "optimizer" not in fresh.private_state()
