"""Drives one SecAgg+ round in process: every client's session and the server's, with dropouts at any stage."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from hetfed.secagg import (
    Aggregate,
    ClientSession,
    Encoding,
    Field,
    RoundConfig,
    SecAggError,
    SeededEntropy,
    ServerSession,
    default_degree,
    default_threshold,
)

STAGES = ("advertise", "share_keys", "mask", "unmask")
WEIGHTS = (Field("w", (3,), 1.0),)


def names(n: int) -> tuple[str, ...]:
    return tuple(f"org-{i:02d}" for i in range(n))


def make_config(n: int, degree: int | None = None, threshold: int | None = None,
                fields: tuple[Field, ...] = WEIGHTS, value_bits: int = 16, run_id: str = "run-a",
                round_no: int = 1, stochastic: bool = True) -> RoundConfig:
    k = default_degree(n) if degree is None else degree
    t = default_threshold(k) if threshold is None else threshold
    return RoundConfig(run_id, round_no, names(n), k, t, hashlib.sha256(b"graph seed").digest(),
                       Encoding.for_inputs(fields, n, value_bits, stochastic))


def random_inputs(config: RoundConfig, seed: int) -> dict[str, dict[str, np.ndarray]]:
    """Values spread over each field's range, a few beyond it (clipped)."""
    rng = np.random.default_rng(seed)
    return {u: {f.name: rng.uniform(-1.2 * f.bound, 1.2 * f.bound, f.shape) for f in config.encoding.fields}
            for u in config.roster}


def rounding_rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, int(hashlib.sha256(name.encode()).hexdigest()[:8], 16)])


@dataclass
class Round:
    config: RoundConfig
    server: ServerSession
    clients: dict[str, ClientSession]
    encoded: dict[str, np.ndarray] = field(default_factory=dict)  # each masked client's plain encoded input
    masked: dict[str, np.ndarray] = field(default_factory=dict)  # what the server received from each
    refused: set[str] = field(default_factory=set)  # clients whose own check refused their input


def start(config: RoundConfig, seed: int = 0) -> Round:
    return Round(config, ServerSession(config),
                 {u: ClientSession(config, u, SeededEntropy(f"{seed}/{u}")) for u in config.roster})


def run_round(config: RoundConfig, inputs: Mapping[str, Mapping[str, np.ndarray]],
              drop: Mapping[str, set[str]] | None = None, seed: int = 0,
              rnd: Round | None = None, strict: bool = False) -> tuple[Round, Aggregate]:
    """The whole round; a client in ``drop[stage]`` sends nothing from that stage on. Raises what the server
    or a client raises (``AbandonedError`` below the threshold), but a client's refusal of its own input in
    ``strict`` mode (``out_of_range``): that client then sends nothing, as a dropout would."""
    drop = drop or {}
    r = rnd or start(config, seed)
    gone: set[str] = set()

    def live(stage: str, names_: object) -> list[str]:
        gone.update(drop.get(stage, set()))
        return [u for u in sorted(names_) if u not in gone]  # type: ignore[call-overload]

    for u in live("advertise", config.roster):
        r.server.receive_advert(r.clients[u].advertise())
    peer_keys = r.server.close_advertising()
    for u in live("share_keys", peer_keys):
        r.server.receive_shared_keys(r.clients[u].share_keys(peer_keys[u]))
    peer_shares = r.server.close_sharing()
    for u in live("mask", peer_shares):
        try:
            msg = r.clients[u].mask(peer_shares[u], inputs[u], rounding_rng(seed, u), strict)
        except SecAggError as exc:
            if exc.reason != "out_of_range":
                raise
            r.refused.add(u)
            continue
        r.encoded[u] = config.encoding.encode(inputs[u], rounding_rng(seed, u))
        r.masked[u] = msg.vector
        r.server.receive_masked(msg)
    requests = r.server.close_masking()
    for u in live("unmask", requests):
        r.server.receive_unmask(r.clients[u].unmask(requests[u]))
    return r, r.server.finish()


def plain_sum(r: Round, survivors: tuple[str, ...]) -> np.ndarray:
    """The survivors' encoded inputs summed as signed integers (int64), with no ring at all."""
    enc = r.config.encoding
    return np.sum([enc.signed(r.encoded[u]) for u in survivors], axis=0, dtype=np.int64).reshape(enc.length)
