"""FedGen's server half on three-element arrays: the FedAvg of encoders and heads against a float64 hand
computation in any arrival order, the generator trained on the round's heads (sorted order, the round seed) and
sent as float32 beside the encoder, a generator that lowers its teacher loss, what it refuses, and a restart
that resumes bit for bit."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from hetfed.aggregator.algorithms import make_server_half
from hetfed.aggregator.algorithms.base import RunInfo, round_seed
from hetfed.aggregator.algorithms.fedgen import (
    FedGenServer,
    GeneratorTrainer,
    forward,
    label_weights,
    teacher_loss,
)
from hetfed.wire.errors import WireError
from hetfed.wire.payloads import ClassCounts, EvalMetrics, HeadWeights, ModelWeights, Received
from hetfed.wire.phases import Phase
from hetfed.wire.specs import get_spec
from hetfed.wire.specs.fedgen import GENERATOR_PREFIX, GENERATOR_TENSORS

SPEC = get_spec("fedgen")
K, D = 3, 2
ORGS = ("a", "b", "c")
RUN = RunInfo(seed=4, organizations=ORGS)
FIELDS = {"num_classes": K, "latent_dim": D, "noise_dim": 3, "hidden_dim": 8, "generator_steps": 20,
          "generator_batch_size": 8, "generator_lr": 1e-2}
EXAMPLES = {"a": 10, "b": 30, "c": 60}
BODY = {"a": np.array([1.0, 2.0, 3.0], np.float32), "b": np.array([-1.0, 0.5, 2.0], np.float32),
        "c": np.array([0.25, 4.0, -3.0], np.float32)}
RNG = np.random.default_rng(0)
HEADS = {o: (RNG.normal(size=(K, D)).astype(np.float32), RNG.normal(size=K).astype(np.float32)) for o in ORGS}
COUNTS = {"a": np.array([5, 5, 0]), "b": np.array([0, 20, 10]), "c": np.array([30, 0, 30])}


def upload(org: str, **changes: object) -> Received:
    w, b = HEADS[org]
    n = EXAMPLES[org]
    parts: dict[str, object] = {"mw": ModelWeights({"enc": BODY[org]}, n), "hw": HeadWeights(w, b, n),
                                "cc": ClassCounts(COUNTS[org])}
    parts.update(changes)
    return Received([*parts.values(), EvalMetrics()], frozenset())  # type: ignore[list-item]


def server(**fields: object) -> FedGenServer:
    half = make_server_half(SPEC, SPEC.config(**{**FIELDS, **fields}), RUN)
    assert isinstance(half, FedGenServer)
    return half


def close(half: FedGenServer, round_: int, orgs: tuple[str, ...] = ORGS) -> None:
    for org in orgs:
        half.validate(Phase.TRAIN, org, upload(org))
        half.accumulate(Phase.TRAIN, org, upload(org))
    half.close_round(Phase.TRAIN, round_)


def hand_mean(values: dict[str, np.ndarray]) -> np.ndarray:
    """Σ n_i v_i / Σ n_i in float64."""
    total = sum(EXAMPLES[o] * values[o].astype(np.float64) for o in ORGS)
    return (total / sum(EXAMPLES.values())).astype(np.float32)


@pytest.mark.parametrize("order", list(itertools.permutations(ORGS)))
def test_encoders_and_heads_are_averaged_and_the_generator_trained_whatever_the_arrival_order(
        order: tuple[str, ...]) -> None:
    half = server()
    assert half.payloads_for(Phase.TRAIN, 1, "a") == []  # nothing before the first close
    close(half, 1, order)
    mw, hw = half.payloads_for(Phase.TRAIN, 2, "b")
    assert isinstance(mw, ModelWeights) and isinstance(hw, HeadWeights)
    np.testing.assert_allclose(mw.tensors["enc"], hand_mean(BODY), rtol=1e-7)
    np.testing.assert_allclose(hw.weight, hand_mean({o: HEADS[o][0] for o in ORGS}), rtol=1e-6)
    np.testing.assert_allclose(hw.bias, hand_mean({o: HEADS[o][1] for o in ORGS}), rtol=1e-6)
    # The generator: one round of the trainer on the heads and counts in sorted order, from round 1's seed.
    ref = GeneratorTrainer(half.config, RUN.seed)
    ref.train_round([(HEADS[o][0].astype(np.float64), HEADS[o][1].astype(np.float64)) for o in ORGS],
                    np.stack([COUNTS[o] for o in ORGS]), round_seed(RUN.seed, 1))
    assert sorted(k for k in mw.tensors if k.startswith(GENERATOR_PREFIX)) == \
        sorted(GENERATOR_PREFIX + n for n in GENERATOR_TENSORS)
    for n in GENERATOR_TENSORS:
        sent = mw.tensors[GENERATOR_PREFIX + n]
        assert sent.dtype == np.float32 and np.array_equal(sent, ref.params[n].astype(np.float32)), n


def test_a_round_of_generator_training_lowers_its_teacher_loss() -> None:
    heads = [(HEADS[o][0].astype(np.float64), HEADS[o][1].astype(np.float64)) for o in ORGS]
    counts = np.stack([COUNTS[o] for o in ORGS])
    trainer = GeneratorTrainer(server(generator_steps=200).config, 0)
    weights, qualified = label_weights(counts)
    assert qualified.tolist() == [0, 1, 2]
    labels = np.tile(np.arange(K), 20)
    eps = np.random.default_rng(9).random((labels.size, 3))

    def loss() -> float:
        return teacher_loss(forward(trainer.params, eps, labels, K).g, labels, heads, weights[labels])[0]

    before = loss()
    trainer.train_round(heads, counts, 1)
    assert loss() < 0.5 * before, (before, loss())


def test_the_learning_rate_decays_a_round() -> None:
    half = server(generator_lr_decay=0.5)
    close(half, 1)
    close(half, 2)
    assert half.generator.rounds == 2 and half.generator.adam.lr == pytest.approx(1e-2 * 0.5)


@pytest.mark.parametrize(("changes", "reason", "text"), [
    ({"hw": HeadWeights(np.zeros((K, D + 1), np.float32), np.zeros(K, np.float32), 10)}, "shape_mismatch",
     "head_weights must be"),
    ({"cc": ClassCounts(np.array([1, -1, 0]))}, "invalid_value", "class_counts"),
    ({"cc": ClassCounts(np.array([1.0, 1.0, 0.0]))}, "invalid_value", "class_counts"),
    ({"mw": ModelWeights({"enc": BODY["a"]}, 0)}, "invalid_value", "num_examples must be > 0"),
    ({"mw": ModelWeights({"enc": BODY["a"], GENERATOR_PREFIX + "fc.weight": BODY["a"]}, 10)}, "invalid_value",
     "generator"),
])
def test_it_refuses_a_head_of_another_shape_bad_counts_or_a_reserved_name(changes: dict[str, object], reason: str,
                                                                          text: str) -> None:
    half = server()
    with pytest.raises(WireError, match=text) as refused:
        half.validate(Phase.TRAIN, "a", upload("a", **changes))
    assert refused.value.reason == reason


def test_a_restart_resumes_bit_for_bit() -> None:
    half = server()
    close(half, 1)
    restored = server()
    restored.load_state(half.state())
    for h in (half, restored):
        close(h, 2)
    (mw1, hw1), (mw2, hw2) = half.payloads_for(Phase.TRAIN, 3, "a"), restored.payloads_for(Phase.TRAIN, 3, "a")
    assert isinstance(mw1, ModelWeights) and isinstance(mw2, ModelWeights)
    assert mw1.tensors.keys() == mw2.tensors.keys()
    assert all(np.array_equal(mw1.tensors[k], mw2.tensors[k]) for k in mw1.tensors)
    assert isinstance(hw1, HeadWeights) and isinstance(hw2, HeadWeights) and np.array_equal(hw1.weight, hw2.weight)
    assert all(np.array_equal(a, restored.generator.state()[k]) for k, a in half.generator.state().items())


def test_nothing_is_trained_or_sent_while_no_label_is_counted() -> None:
    half = server()
    for org in ORGS:
        update = upload(org, cc=ClassCounts(np.zeros(K, np.int64)))
        half.validate(Phase.TRAIN, org, update)
        half.accumulate(Phase.TRAIN, org, update)
    half.close_round(Phase.TRAIN, 1)
    (mw, _) = half.payloads_for(Phase.TRAIN, 2, "a")
    assert isinstance(mw, ModelWeights) and list(mw.tensors) == ["enc"] and half.generator.rounds == 0


def test_sharing_the_head_alone_averages_heads_and_sends_the_generator_without_an_encoder() -> None:
    spec = get_spec("fedgen_head")
    half = make_server_half(spec, spec.config(**FIELDS), RUN)
    assert isinstance(half, FedGenServer) and spec.model_private
    for org in ORGS:
        w, b = HEADS[org]
        update = Received([HeadWeights(w, b, EXAMPLES[org]), ClassCounts(COUNTS[org]), EvalMetrics()], frozenset())
        half.validate(Phase.TRAIN, org, update)
        half.accumulate(Phase.TRAIN, org, update)
    half.close_round(Phase.TRAIN, 1)
    mw, hw = half.payloads_for(Phase.TRAIN, 2, "a")
    assert isinstance(mw, ModelWeights) and isinstance(hw, HeadWeights)
    assert sorted(mw.tensors) == sorted(GENERATOR_PREFIX + n for n in GENERATOR_TENSORS)  # no encoder tensor
    np.testing.assert_allclose(hw.weight, hand_mean({o: HEADS[o][0] for o in ORGS}), rtol=1e-6)
    # The same generator as the encoder-sharing server's: it sees the same heads and counts.
    full = server()
    close(full, 1)
    (full_mw, _) = full.payloads_for(Phase.TRAIN, 2, "a")
    assert isinstance(full_mw, ModelWeights)
    assert all(np.array_equal(mw.tensors[k], full_mw.tensors[k]) for k in mw.tensors)
