"""FedGen's client half: the generator it rebuilds from the server's tensors (against the server's numpy pass), its
two generated terms against a float64 recomputation with the same draws, the decay of α and β, the label counts it
sends, what it loads, and the wire contract that refuses what FedGen does not declare."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from hetfed.aggregator.algorithms.fedgen import eval_forward, init_generator
from hetfed.client.algorithms import ClientContext, make_client_half
from hetfed.client.algorithms.fedgen import FedGenClient, Regulariser
from hetfed.client.data.core import ArrayDataset, ClientData
from hetfed.client.models import SplitModel
from hetfed.client.training import Batch, Forward, cross_entropy
from hetfed.wire import codec
from hetfed.wire.contract import check_update, schema_from_declared
from hetfed.wire.errors import WireError
from hetfed.wire.payloads import (
    ClassCounts,
    ClassMeanEmbeddings,
    EvalMetrics,
    HeadWeights,
    ModelWeights,
    Payload,
    Received,
)
from hetfed.wire.phases import Phase
from hetfed.wire.specs import get_spec
from hetfed.wire.specs.fedgen import GENERATOR_PREFIX, regulariser_weight

torch.set_num_threads(1)
N, FEATURES, LATENT, K, NOISE, HIDDEN = 25, 4, 3, 3, 2, 5
SEED, ORG = 7, "org-0"
CONFIG = {"latent_dim": LATENT, "num_classes": K, "noise_dim": NOISE, "hidden_dim": HIDDEN, "batch_size": 5,
          "local_steps": 10, "gen_batch_size": 4}
BODY = ["encoder.0.weight", "encoder.0.bias"]
SPEC = get_spec("fedgen")


def model() -> SplitModel:
    torch.manual_seed(0)
    return SplitModel(nn.Sequential(nn.Linear(FEATURES, LATENT), nn.Tanh()), LATENT, K)


def data() -> ClientData:
    rng = np.random.default_rng(3)
    x = rng.normal(size=(N, FEATURES)).astype(np.float32)
    y = rng.integers(0, K, size=N)
    return ClientData(ArrayDataset(x, y), ArrayDataset(x[:5], y[:5]), None, K, (FEATURES,), "tiny")


def half(**fields: Any) -> FedGenClient:
    ctx = ClientContext(ORG, model(), data(), torch.device("cpu"), SPEC.config(**{**CONFIG, **fields}), SEED)
    h = make_client_half(SPEC, ctx)
    assert isinstance(h, FedGenClient)
    return h


def generator_arrays(seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    params = init_generator(rng, NOISE, K, HIDDEN, LATENT)
    params["bn.running_mean"] = rng.normal(size=HIDDEN)
    params["bn.running_var"] = rng.uniform(0.5, 2.0, HIDDEN)
    params["bn.weight"] = rng.uniform(0.5, 1.5, HIDDEN)
    return params


def download(h: FedGenClient, with_generator: bool = True) -> Received:
    state = {n: p.detach().numpy() + 0.5 for n, p in h.ctx.model.named_parameters()}
    tensors = {n: state[n].astype(np.float32) for n in BODY}
    if with_generator:
        tensors |= {GENERATOR_PREFIX + n: a.astype(np.float32) for n, a in generator_arrays().items()}
    head = HeadWeights(state["head.weight"].astype(np.float32), state["head.bias"].astype(np.float32))
    return Received([ModelWeights(tensors), head], frozenset())


def test_the_generator_it_builds_runs_as_the_servers_eval_pass() -> None:
    h = half()
    params = generator_arrays()
    gen = h.build_generator({n: a.astype(np.float32) for n, a in params.items()})
    eps = np.random.default_rng(2).random((6, NOISE))
    labels = np.array([0, 1, 2, 2, 1, 0])
    with torch.no_grad():
        out = gen(torch.tensor(eps, dtype=torch.float32), torch.tensor(labels)).numpy()
    np.testing.assert_allclose(out, eval_forward(params, eps, labels, K), rtol=1e-5, atol=1e-5)
    assert not gen.training and not any(p.requires_grad for p in gen.parameters())
    with pytest.raises(ValueError, match=r"generator tensor fc\.weight"):
        h.build_generator({**params, "fc.weight": np.zeros((HIDDEN, NOISE + K + 1))})


def test_regulariser_weights_decay_by_round_with_a_floor() -> None:
    assert regulariser_weight(10.0, 0.98, 1) == 10.0
    assert regulariser_weight(10.0, 0.98, 3) == pytest.approx(10.0 * 0.98 ** 2, rel=1e-15)
    assert regulariser_weight(10.0, 0.98, 10_000) == 1e-4


def test_the_generated_terms_against_a_float64_recomputation_with_the_same_draws() -> None:
    h = half(gen_alpha=3.0, gen_beta=2.0)
    params = generator_arrays()
    gen = h.build_generator({n: a.astype(np.float32) for n, a in params.items()})
    m = h.ctx.model
    assert isinstance(m, SplitModel)
    round_ = 4
    reg = Regulariser(m, gen, h.config, round_, np.random.default_rng(5))
    x = torch.tensor(np.random.default_rng(6).normal(size=(5, FEATURES)), dtype=torch.float32)
    y = torch.tensor([0, 2, 1, 1, 0])
    batch = Batch(x, y)
    out = Forward(m(x))
    latent, teacher = (float(t(batch, out).detach()) for t in reg.terms())
    # The same draws, in the same order: ε for the batch's labels, then ŷ, then ε̂.
    rng = np.random.default_rng(5)
    eps = rng.random((5, NOISE), dtype=np.float32).astype(np.float64)
    y_hat = rng.integers(0, K, 4)
    eps_hat = rng.random((4, NOISE), dtype=np.float32).astype(np.float64)
    w = m.head.weight.detach().double().numpy()
    b = m.head.bias.detach().double().numpy()
    f32 = {n: a.astype(np.float32).astype(np.float64) for n, a in params.items()}

    def log_softmax(z: np.ndarray) -> np.ndarray:
        z = z - z.max(axis=1, keepdims=True)
        return z - np.log(np.exp(z).sum(axis=1, keepdims=True))

    logp_target = log_softmax(eval_forward(f32, eps, y.numpy(), K) @ w.T + b)
    logp_x = log_softmax(out.logits.detach().double().numpy())
    beta_t, alpha_t = 2.0 * 0.98 ** 3, 3.0 * 0.98 ** 3
    kl = (np.exp(logp_target) * (logp_target - logp_x)).sum() / 5
    assert latent == pytest.approx(beta_t * kl, rel=1e-5)
    ce = -log_softmax(eval_forward(f32, eps_hat, y_hat, K) @ w.T + b)[np.arange(4), y_hat].mean()
    assert teacher == pytest.approx(alpha_t * (4 / 5) * ce, rel=1e-5)


def test_the_generated_sample_term_trains_the_head_alone() -> None:
    h = half()
    gen = h.build_generator({n: a.astype(np.float32) for n, a in generator_arrays().items()})
    m = h.ctx.model
    assert isinstance(m, SplitModel)
    reg = Regulariser(m, gen, h.config, 2, np.random.default_rng(0))
    x = torch.zeros(5, FEATURES)
    term = reg.teacher(Batch(x, torch.zeros(5, dtype=torch.int64)), Forward(m(x)))
    term.backward()
    grads = {n: p.grad for n, p in m.named_parameters()}
    assert all(grads[n] is None for n in BODY)
    assert all(grads[n] is not None and grads[n].abs().sum() > 0 for n in ("head.weight", "head.bias"))


def test_round_one_trains_on_cross_entropy_alone_and_later_rounds_add_both_terms() -> None:
    h = half()
    assert h.terms_for(1, np.random.default_rng(0)) == [cross_entropy]
    h.load(download(h))
    assert h.generator is not None and len(h.terms_for(2, np.random.default_rng(0))) == 3


def test_it_loads_encoder_head_and_generator_and_sends_encoder_head_and_the_batches_label_counts() -> None:
    h = half()
    sent = download(h)
    up = h.train(2, 11, sent)
    mw, hw, cc, metrics = up
    assert isinstance(mw, ModelWeights) and isinstance(hw, HeadWeights) and isinstance(cc, ClassCounts)
    assert isinstance(metrics, EvalMetrics) and metrics.train_loss > 0
    assert sorted(mw.tensors) == sorted(BODY) and mw.num_examples == hw.num_examples == N
    assert h.generator is not None
    # 10 steps of batch 5 over 25 examples: two whole epochs, every label counted twice.
    assert cc.counts.dtype == np.int64 and np.array_equal(cc.counts, 2 * np.bincount(data().train.y, minlength=K))
    # The evaluate round loads without training.
    h2 = half()
    h2.evaluate(3, sent)
    received = sent.get(ModelWeights).tensors
    assert all(np.array_equal(p.detach().numpy(), received[n]) for n, p in h2.ctx.model.named_parameters()
               if n in BODY)
    assert np.array_equal(h2.ctx.model.head.weight.detach().numpy(), sent.get(HeadWeights).weight)


def _protos(payloads: list[Payload]) -> list[Any]:
    return [codec.payload_to_proto(p) for p in payloads]


def test_the_contract_accepts_its_upload_and_refuses_what_fedgen_does_not_declare() -> None:
    h = half()
    schema = schema_from_declared(h.declarations(None), SPEC)
    assert sorted(schema[ModelWeights.kind]) == sorted(BODY) and sorted(schema[HeadWeights.kind]) == ["bias", "weight"]
    up = h.train(1, 11, Received([], frozenset()))
    received = check_update(SPEC, Phase.TRAIN, _protos(up), schema, 10**6)
    assert received.kinds == {p.kind for p in up}
    prototypes = ClassMeanEmbeddings(np.arange(K), np.zeros((K, LATENT), np.float32), np.ones(K, np.int64),
                                     np.ones(K, bool))
    with pytest.raises(WireError, match="fedgen does not accept class_mean_embeddings") as refused:
        check_update(SPEC, Phase.TRAIN, _protos([*up, prototypes]), schema, 10**6)
    assert refused.value.reason == "payload_kind_not_allowed"
    with pytest.raises(WireError, match="class_counts") as refused:  # the counts are required
        check_update(SPEC, Phase.TRAIN, _protos([p for p in up if not isinstance(p, ClassCounts)]), schema, 10**6)
    assert refused.value.reason == "missing_payload"
    mw = up[0]
    assert isinstance(mw, ModelWeights)
    head_in_body = ModelWeights({**mw.tensors, "head.weight": np.zeros((K, LATENT), np.float32)}, N)
    with pytest.raises(WireError, match="unexpected tensors"):  # the head goes as HeadWeights only
        check_update(SPEC, Phase.TRAIN, _protos([head_in_body, *up[1:]]), schema, 10**6)


def test_it_refuses_a_model_of_another_width() -> None:
    with pytest.raises(ValueError, match="latent_dim=4"):
        half(latent_dim=4)


def test_it_serves_no_privacy_mechanism() -> None:
    # The label counts go up raw: under [privacy] the runtime refuses a half without a mechanism after Join.
    assert FedGenClient.privacy_mechanism is None


def test_sharing_the_head_alone_declares_and_sends_no_encoder_and_the_contract_refuses_one() -> None:
    spec = get_spec("fedgen_head")
    ctx = ClientContext(ORG, model(), data(), torch.device("cpu"), spec.config(**CONFIG), SEED)
    h = make_client_half(spec, ctx)
    assert isinstance(h, FedGenClient)
    schema = schema_from_declared(h.declarations(None), spec)
    assert list(schema) == [HeadWeights.kind]
    before = {n: p.detach().numpy().copy() for n, p in h.ctx.model.named_parameters() if n in BODY}
    generator = {GENERATOR_PREFIX + n: a.astype(np.float32) for n, a in generator_arrays().items()}
    head = HeadWeights(np.ones((K, LATENT), np.float32), np.zeros(K, np.float32))
    up = h.train(2, 11, Received([ModelWeights(generator), head], frozenset()))
    assert [type(p) for p in up] == [HeadWeights, ClassCounts, EvalMetrics] and h.generator is not None
    assert any(not np.array_equal(before[n], p.detach().numpy()) for n, p in h.ctx.model.named_parameters()
               if n in BODY)  # the encoder trained, and stays here
    assert check_update(spec, Phase.TRAIN, _protos(up), schema, 10**6).kinds == {p.kind for p in up}
    encoder = ModelWeights(dict(before), N)
    with pytest.raises(WireError, match="fedgen_head does not accept model_weights") as refused:
        check_update(spec, Phase.TRAIN, _protos([encoder, *up]), schema, 10**6)
    assert refused.value.reason == "payload_kind_not_allowed"
