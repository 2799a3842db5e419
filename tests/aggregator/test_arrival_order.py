"""Every registered algorithm's server half gives the same state and sends the same payloads, bit for bit,
whatever order the same updates arrive in (seeded shuffles), and after a restart that replays them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from hetfed.aggregator.algorithms import make_server_half
from hetfed.aggregator.algorithms.base import RunInfo, ServerHalf
from hetfed.wire.payloads import (
    ClassCounts,
    ClassMeanEmbeddings,
    CriteriaEmbeddings,
    EvalMetrics,
    FactorizedLayer,
    FactorizedWeights,
    HeadWeights,
    ModelWeights,
    Payload,
    PayloadKind,
    PeerWeights,
    Received,
    SeedPosteriors,
)
from hetfed.wire.phases import Phase
from hetfed.wire.specs import SPECS, AlgorithmSpec

ORGS = ("amber", "birch", "cedar", "dune", "elm", "fjord")
RUN = RunInfo(seed=13, organizations=ORGS)
ROUNDS = 3
SHUFFLES = 4


def _scaled(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Float32 values over nine decades, so float64 sums in different orders round differently."""
    return (rng.standard_normal(shape) * 10.0 ** rng.integers(-6, 4, shape)).astype(np.float32)


def _unit(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return rng.uniform(0.0, 1.0, shape).astype(np.float32)


class Uploads:
    """Seeded, valid uploads of every payload kind, for one organization of one round."""

    def __init__(self, config: Any, org: int, round_: int) -> None:
        self.rng = np.random.default_rng([RUN.seed, org, round_])
        self.org = org
        self.k = getattr(config, "num_classes", 5)
        self.d = getattr(config, "latent_dim", 6)
        # The setup counts do not change between rounds (Fed-CMA checks later counts against them).
        self.counts = np.random.default_rng([RUN.seed, org]).integers(0, 40, self.k).astype(np.int64)
        self.counts[org % self.k] += 1

    def make(self, kind: PayloadKind, sent: list[Payload] | None = None) -> Payload | None:
        rng, k, d = self.rng, self.k, self.d
        if kind is PayloadKind.MODEL_WEIGHTS:
            return ModelWeights({"encoder.weight": _scaled(rng, (40, 30)), "encoder.bias": _scaled(rng, (30,)),
                                 "head.weight": _scaled(rng, (k, 30))}, int(rng.integers(1, 300)))
        if kind is PayloadKind.HEAD_WEIGHTS:
            return HeadWeights(_scaled(rng, (k, d)), _scaled(rng, (k,)), int(rng.integers(1, 300)))
        if kind is PayloadKind.CLASS_COUNTS:
            return ClassCounts(self.counts.copy())
        if kind is PayloadKind.CLASS_MEAN_EMBEDDINGS:
            counts = rng.integers(0, self.counts + 1).astype(np.int64)
            return ClassMeanEmbeddings(np.arange(k, dtype=np.int64), _unit(rng, (k, d)), counts, counts > 0)
        if kind is PayloadKind.SEED_POSTERIORS:
            # The same public examples for every organization (a consensus over the round's subset needs them).
            p = rng.dirichlet(np.ones(k), 4).astype(np.float32)
            return SeedPosteriors("seeds", np.arange(4, dtype=np.int64), p / p.sum(1, keepdims=True),
                                  float(rng.uniform()))
        if kind is PayloadKind.FACTORIZED_WEIGHTS:
            idx = np.sort(rng.choice(8 * 5, 9, replace=False)).astype(np.int64)
            layer = FactorizedLayer("encoder.0", _scaled(rng, (8,)), _scaled(rng, (5,)), idx, _scaled(rng, (9,)), (8, 5))
            return FactorizedWeights((layer,), int(rng.integers(1, 300)))
        if kind is PayloadKind.CRITERIA_EMBEDDINGS:
            return CriteriaEmbeddings("criteria", rng.standard_normal((2, 4)).astype(np.float32))
        if kind is PayloadKind.EVAL_METRICS:
            return EvalMetrics(train_loss=float(rng.uniform()), num_train_examples=10)
        if kind is PayloadKind.PEER_WEIGHTS:
            # The organization itself, then the peers it was sent, in order (none sent: nothing to report).
            names = [p for p in sent or [] if isinstance(p, PeerWeights)]
            if not names:
                return None
            peers = names[0].organizations
            return PeerWeights((ORGS[self.org], *peers), _scaled(rng, (len(peers) + 1,)))
        raise AssertionError(f"no test upload for {kind}: add one here")


def canonical(value: Any) -> Any:
    """Payloads and arrays as comparable bytes: dtype, shape and every bit."""
    if isinstance(value, np.ndarray):
        return ("array", value.dtype.str, value.shape, value.tobytes())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (type(value).__name__, tuple((f.name, canonical(getattr(value, f.name)))
                                            for f in dataclasses.fields(value)))
    if isinstance(value, dict):
        return ("dict", tuple((k, canonical(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return tuple(canonical(v) for v in value)
    return value


def received(spec: AlgorithmSpec, phase: Phase, config: Any, org: int, round_: int,
             sent: list[Payload] | None = None) -> Received:
    """Organization ``org``'s upload of every kind its phase allows (``sent``: what it was sent this round)."""
    kinds = spec.setup_upload if phase is Phase.SETUP else spec.upload
    make = Uploads(config, org, round_).make
    made = [make(kind, sent) for kind in sorted(kinds, key=lambda k: k.value)]
    return Received([p for p in made if p is not None], spec.repeated_download)


def drive(spec: AlgorithmSpec, config: Any, order: Callable[[int], list[int]],
          half: ServerHalf | None = None) -> list[Any]:  # type: ignore[type-arg]
    """The payloads every organization is sent before each round, and the state after each close, with the
    organizations of round r pushing in ``order(r)``."""
    half = half or make_server_half(spec, config, RUN)
    seen: list[Any] = []
    phases = [(Phase.SETUP, 0)] if spec.setup_upload else []
    for phase, round_ in [*phases, *((Phase.TRAIN, r) for r in range(1, ROUNDS + 1)), (Phase.EVALUATE, ROUNDS + 1)]:
        sent = [half.payloads_for(phase, round_, org) for org in ORGS]
        seen.append([canonical(p) for p in sent])
        for i in order(round_):
            update = received(spec, phase, config, i, round_, sent[i]) if phase is not Phase.EVALUATE else \
                Received([EvalMetrics()])
            half.validate(phase, ORGS[i], update)
            half.accumulate(phase, ORGS[i], update)
        half.close_round(phase, round_)
        seen.append(canonical(half.state()))
    return seen


def configs(spec: AlgorithmSpec) -> list[Any]:
    """The spec's default config, and each aggregation of the averaging family (the robust ones without the
    distance bound: independent random updates lie far from their trimmed mean)."""
    base = spec.config()
    if hasattr(base, "aggregation"):
        return [base, dataclasses.replace(base, aggregation="trimmed_mean", trim=2, max_update_norm_ratio=0.0),
                dataclasses.replace(base, aggregation="median", max_update_norm_ratio=0.0),
                dataclasses.replace(base, update_norm_policy="clip", max_update_norm_ratio=0.5)]
    return [base]


def shuffled(seed: int) -> Callable[[int], list[int]]:
    """A seeded arrival order for each round."""
    return lambda r: [int(i) for i in np.random.default_rng([seed, r]).permutation(len(ORGS))]


CASES = [pytest.param(spec, i, id=f"{name}-{i}") for name, spec in SPECS.items() for i in range(len(configs(spec)))]


@pytest.mark.parametrize(("spec", "variant"), CASES)
def test_shuffled_arrivals_give_the_same_bits(spec: AlgorithmSpec, variant: int) -> None:
    config = configs(spec)[variant]
    want = drive(spec, config, lambda r: list(range(len(ORGS))))
    for seed in range(SHUFFLES):
        got = drive(spec, config, shuffled(seed))
        assert got == want, f"{spec.name}: arrival order {seed} changed the result"


@pytest.mark.parametrize("spec", [s for s in SPECS.values() if s.name in ("fedavg", "fedcma")], ids=lambda s: s.name)
def test_a_restart_that_replays_the_open_round_in_another_order_gives_the_same_bits(spec: AlgorithmSpec) -> None:
    config = spec.config()
    first = spec.first_phase
    straight = make_server_half(spec, config, RUN)
    if first is Phase.SETUP:
        for i in range(len(ORGS)):
            straight.accumulate(Phase.SETUP, ORGS[i], received(spec, Phase.SETUP, config, i, 0))
        straight.close_round(Phase.SETUP, 0)
    checkpoint = straight.state()
    updates = [(ORGS[i], received(spec, Phase.TRAIN, config, i, 1)) for i in range(len(ORGS))]
    for org, update in updates:
        straight.accumulate(Phase.TRAIN, org, update)
    straight.close_round(Phase.TRAIN, 1)
    # The restarted half: the checkpoint, then the open round's logged updates, read back in another order.
    restarted = make_server_half(spec, config, RUN)
    restarted.load_state(checkpoint)
    for org, update in reversed(updates):
        restarted.accumulate(Phase.TRAIN, org, update)
    restarted.close_round(Phase.TRAIN, 1)
    assert canonical(restarted.state()) == canonical(straight.state())
    assert canonical(restarted.payloads_for(Phase.TRAIN, 2, ORGS[0])) == \
        canonical(straight.payloads_for(Phase.TRAIN, 2, ORGS[0]))


def test_the_shuffles_would_catch_a_sum_in_arrival_order() -> None:
    """The same uploads summed with a running float64 ``+=`` differ between the shuffles used above."""
    spec = SPECS["fedavg"]
    sums = set()
    for seed in range(SHUFFLES):
        total = np.zeros((40, 30))
        for i in np.random.default_rng([seed, 1]).permutation(len(ORGS)):
            mw = received(spec, Phase.TRAIN, spec.config(), int(i), 1).get(ModelWeights)
            total += mw.num_examples * mw.tensors["encoder.weight"].astype(np.float64)
        sums.add(total.tobytes())
    assert len(sums) > 1


def test_a_rounds_reports_are_listed_by_organization_whatever_order_they_came_in() -> None:
    """The history line and the Status summary list reports by name, so a mean over them (the CLI's table)
    adds the same floats in the same order."""
    from hetfed.aggregator.journal.history import RoundRecord

    metrics = {org: EvalMetrics(test_accuracy=0.1 * (i + 1) + 1e-9 * i, num_test_examples=7 * i + 3)
               for i, org in enumerate(ORGS)}
    lines, summaries = set(), set()
    for seed in range(SHUFFLES):
        rec = RoundRecord(1, Phase.TRAIN, 0.0)
        for i in np.random.default_rng(seed).permutation(len(ORGS)):
            rec.reports[ORGS[i]] = metrics[ORGS[i]]
        lines.add(repr(rec.to_json()))
        summaries.add(tuple(rec.summary().reports))
    assert len(lines) == 1 and summaries == {ORGS}
