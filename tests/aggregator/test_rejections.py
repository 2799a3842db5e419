"""Every rejection reason, sent to a running aggregator: exact status, precise message, counted, round unharmed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import pytest

from hetfed.v1 import aggregator_pb2 as apb
from hetfed.v1 import payloads_pb2 as pb
from hetfed.wire import codec
from hetfed.wire.payloads import EvalMetrics, HeadWeights, ModelWeights, PayloadKind
from tests.conftest import RawClient, run_config

W = {"w": np.array([1.0, 2.0, 3.0], np.float32), "b": np.array([0.5, -0.5], np.float32)}
DECL = [(PayloadKind.MODEL_WEIGHTS, k, v) for k, v in W.items()]


def good(scale: float = 1.0, n: int = 10, **weights: np.ndarray) -> list[Any]:
    tensors = {k: v * scale for k, v in W.items()}
    tensors.update(weights)
    return [ModelWeights(tensors, n), EvalMetrics(train_loss=0.5, test_accuracy=0.9, num_test_examples=5)]


def rejected(agg: Any, reason: str, run: str = "r") -> float:
    value = agg.service.metrics.registry.get_sample_value(
        "hetfed_rejected_messages_total", {"run": run, "reason": reason}
    )
    return value or 0.0


@pytest.fixture
def fed(aggregator: Callable[..., Any], raw_client: Callable[..., RawClient]) -> tuple[Any, RawClient, RawClient]:
    agg = aggregator(run_config(), max_update_bytes=1 << 20)
    a, b = raw_client(agg.port, "a"), raw_client(agg.port, "b")
    a.join(DECL)
    b.join(DECL)
    assert a.pull().action == apb.ACTION_TRAIN
    return agg, a, b


def finish_round_and_check(a: RawClient, b: RawClient) -> None:
    """The good updates of a (n=10, W) and b (n=30, 3W) still make round 1's FedAvg exactly 2.5·W."""
    a.push(1, good(1.0, 10))
    b.push(1, good(3.0, 30))
    ins = a.pull(completed=1)
    assert ins.action == apb.ACTION_TRAIN and ins.envelope.round == 2
    mw = codec.payload_from_proto(ins.payloads[0])
    assert isinstance(mw, ModelWeights)
    for k, v in W.items():
        np.testing.assert_array_equal(mw.tensors[k], v * 2.5)


def _tamper_digest(parts: list[apb.Chunk]) -> list[apb.Chunk]:
    parts[-1].blake3 = b"\x00" * 32
    return parts


def _reorder(parts: list[apb.Chunk]) -> list[apb.Chunk]:
    return [parts[1], parts[0], *parts[2:]]


def _drop_last(parts: list[apb.Chunk]) -> list[apb.Chunk]:
    return parts[:-1]


def _empty_payload(a: RawClient) -> None:
    env = apb.Envelope(run_id="r", round=1, organization_id="a",
                       payload_kinds=[PayloadKind.MODEL_WEIGHTS.proto_enum])
    data = apb.Update(envelope=env, payloads=[pb.Payload()]).SerializeToString()
    a.push_bytes(1, data)


BAD: dict[str, tuple[Callable[[RawClient], object], grpc.StatusCode, str, str]] = {
    "garbage bytes": (lambda a: a.push_bytes(1, b"\xff\xfe not a protobuf"), grpc.StatusCode.INVALID_ARGUMENT,
                      "malformed", "not a valid hetfed.v1.Update"),
    "empty payload oneof": (_empty_payload, grpc.StatusCode.INVALID_ARGUMENT, "malformed", "empty oneof"),
    "bad checksum": (lambda a: a.push_bytes(1, a.update_bytes(1, good()), tamper=_tamper_digest),
                     grpc.StatusCode.INVALID_ARGUMENT, "checksum_mismatch", "BLAKE3 digest"),
    "chunks out of order": (lambda a: a.push_bytes(1, a.update_bytes(1, good()), chunk_bytes=16, tamper=_reorder),
                            grpc.StatusCode.INVALID_ARGUMENT, "malformed", "out of order"),
    "stream cut short": (lambda a: a.push_bytes(1, a.update_bytes(1, good()), chunk_bytes=16, tamper=_drop_last),
                         grpc.StatusCode.ABORTED, "incomplete", "ended after"),
    "envelope names another org": (
        lambda a: a.push_bytes(1, a.update_bytes(1, good(), envelope=apb.Envelope(
            run_id="r", round=1, organization_id="b", payload_kinds=[1, 8]))),
        grpc.StatusCode.INVALID_ARGUMENT, "envelope_mismatch", "organization 'b'"),
    "metrics missing weights": (lambda a: a.push(1, good()[1:]), grpc.StatusCode.INVALID_ARGUMENT,
                                "missing_payload", "model_weights"),
    "two metrics payloads": (lambda a: a.push(1, [*good(), EvalMetrics()]), grpc.StatusCode.INVALID_ARGUMENT,
                             "duplicate_payload", "two eval_metrics"),
    "head weights under fedavg": (
        lambda a: a.push(1, [*good(), HeadWeights(np.zeros((2, 3), np.float32), np.zeros(2, np.float32), 1)]),
        grpc.StatusCode.PERMISSION_DENIED, "payload_kind_not_allowed", "does not accept head_weights"),
    "float16 instead of float32": (
        lambda a: a.push_bytes(1, a.update_bytes(1, good(), wire_dtype="float16")),
        grpc.StatusCode.INVALID_ARGUMENT, "dtype_mismatch", "model_weights.w: dtype float16"),
    "wrong shape": (lambda a: a.push(1, good(w=np.zeros(4, np.float32))), grpc.StatusCode.INVALID_ARGUMENT,
                    "shape_mismatch", "shape [4], the run declared [3]"),
    "unknown tensor": (lambda a: a.push(1, good(extra=np.zeros(1, np.float32))), grpc.StatusCode.INVALID_ARGUMENT,
                       "shape_mismatch", "unexpected tensors ['extra']"),
    "NaN weights": (lambda a: a.push(1, good(w=np.array([1, np.nan, 3], np.float32))),
                    grpc.StatusCode.INVALID_ARGUMENT, "non_finite", "model_weights.w holds 1 NaN"),
    "infinite metric": (lambda a: a.push(1, [good()[0], EvalMetrics(train_loss=float("inf"))]),
                        grpc.StatusCode.INVALID_ARGUMENT, "non_finite", "eval_metrics.train_loss"),
    "zero examples": (lambda a: a.push(1, good(n=0)), grpc.StatusCode.INVALID_ARGUMENT, "invalid_value",
                      "num_examples must be > 0"),
    # Implausible values, one at a time, so each reason is seen alone: each refused with its reason, the round's model unchanged.
    "a billion examples, none declared": (
        lambda a: a.push(1, good(n=10**9)), grpc.StatusCode.INVALID_ARGUMENT, "invalid_value",
        "model_weights claims 1000000000 training examples; it declared none, and the limit is 10000000"),
    "weights of 1e30": (lambda a: a.push(1, good(w=np.array([1e30, -1e30, 1], np.float32))),
                        grpc.StatusCode.INVALID_ARGUMENT, "implausible_update",
                        "w holds a value of magnitude 1e+30; at most 1e+06 (max_abs_weight)"),
    "accuracy 1e300": (lambda a: a.push(1, [good()[0], EvalMetrics(test_accuracy=1e300)]),
                       grpc.StatusCode.INVALID_ARGUMENT, "implausible_metric",
                       "eval_metrics.test_accuracy is 1e+300; an accuracy is in [0, 1]"),
    "accuracy -3": (lambda a: a.push(1, [good()[0], EvalMetrics(test_accuracy=-3.0)]),
                    grpc.StatusCode.INVALID_ARGUMENT, "implausible_metric", "eval_metrics.test_accuracy is -3"),
    "train loss -5": (lambda a: a.push(1, [good()[0], EvalMetrics(train_loss=-5.0)]),
                      grpc.StatusCode.INVALID_ARGUMENT, "implausible_metric",
                      "eval_metrics.train_loss is -5; a loss is finite and >= 0"),
    "test loss -1e-9": (lambda a: a.push(1, [good()[0], EvalMetrics(test_loss=-1e-9)]),
                        grpc.StatusCode.INVALID_ARGUMENT, "implausible_metric", "eval_metrics.test_loss is -1e-09"),
    "negative test count": (lambda a: a.push(1, [good()[0], EvalMetrics(num_test_examples=-1)]),
                            grpc.StatusCode.INVALID_ARGUMENT, "invalid_value", "claims -1 test examples"),
    "oversized": (lambda a: a.push(1, good(w=np.zeros(300_000, np.float32))),
                  grpc.StatusCode.RESOURCE_EXHAUSTED, "oversized", "exceeds the limit of 1048576 bytes"),
    "closed round": (lambda a: a.push(0, good()), grpc.StatusCode.FAILED_PRECONDITION, "late",
                     "round 0 is closed; the current round is 1"),
    "future round": (lambda a: a.push(7, good()), grpc.StatusCode.FAILED_PRECONDITION, "late",
                     "round 7 has not started; the current round is 1"),
    "claims another org": (lambda a: a.push(1, good(), organization="b"), grpc.StatusCode.PERMISSION_DENIED,
                           "identity_mismatch", "metadata names 'a', the request claims 'b'"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_push_is_rejected_counted_and_harmless(fed: tuple[Any, RawClient, RawClient], case: str) -> None:
    agg, a, b = fed
    send, code, reason, detail = BAD[case]
    before = rejected(agg, reason)
    with pytest.raises(grpc.RpcError) as err:
        send(a)
    assert err.value.code() == code
    assert err.value.details().startswith(f"{reason}: ")
    assert detail in err.value.details()
    assert rejected(agg, reason) == before + 1
    assert agg.service.runs["r"].pushed == {}
    finish_round_and_check(a, b)


def test_unknown_organization_is_denied(fed: tuple[Any, RawClient, RawClient],
                                        raw_client: Callable[..., RawClient]) -> None:
    agg, a, b = fed
    mallory = raw_client(agg.port, "mallory")
    for call in (lambda: mallory.join(DECL), lambda: mallory.push(1, good()), lambda: mallory.pull()):
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "organization 'mallory' is not part of run 'r'" in err.value.details()
    assert rejected(agg, "unknown_organization") == 3
    finish_round_and_check(a, b)


def test_no_identity_is_unauthenticated(fed: tuple[Any, RawClient, RawClient],
                                        raw_client: Callable[..., RawClient]) -> None:
    agg, a, b = fed
    anon = raw_client(agg.port, "", header="")
    with pytest.raises(grpc.RpcError) as err:
        anon.join(DECL)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert rejected(agg, "unauthenticated") == 1
    finish_round_and_check(a, b)


def test_unknown_run_is_not_found(fed: tuple[Any, RawClient, RawClient],
                                  raw_client: Callable[..., RawClient]) -> None:
    agg, a, b = fed
    other = raw_client(agg.port, "a", run="nope")
    with pytest.raises(grpc.RpcError) as err:
        other.join(DECL)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert "no run 'nope'" in err.value.details()
    finish_round_and_check(a, b)


def test_mismatched_schema_at_join(fed: tuple[Any, RawClient, RawClient]) -> None:
    agg, a, b = fed
    bad = [(PayloadKind.MODEL_WEIGHTS, "w", np.zeros(5, np.float32)), DECL[1]]
    with pytest.raises(grpc.RpcError) as err:
        b.join(bad)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "model_weights.w: declared float32[5], the run has float32[3]" in err.value.details()
    assert rejected(agg, "schema_mismatch") == 1
    finish_round_and_check(a, b)


def test_push_before_join(aggregator: Callable[..., Any], raw_client: Callable[..., RawClient]) -> None:
    agg = aggregator(run_config())
    a, b = raw_client(agg.port, "a"), raw_client(agg.port, "b")
    a.join(DECL)
    with pytest.raises(grpc.RpcError) as err:
        b.push(1, good())
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "must Join run 'r' first" in err.value.details()
    b.join(DECL)
    finish_round_and_check(a, b)


def test_retry_is_idempotent_and_replay_is_refused(fed: tuple[Any, RawClient, RawClient]) -> None:
    agg, a, b = fed
    data = a.update_bytes(1, good(1.0, 10))
    first = a.push_bytes(1, data)
    assert first.accepted and not first.duplicate
    again = a.push_bytes(1, data)
    assert again.accepted and again.duplicate
    assert agg.service.metrics.registry.get_sample_value("hetfed_duplicate_pushes_total", {"run": "r"}) == 1
    with pytest.raises(grpc.RpcError) as err:
        a.push(1, good(100.0, 10))
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "already pushed a different update for round 1" in err.value.details()
    assert rejected(agg, "replayed") == 1
    b.push(1, good(3.0, 30))
    mw = codec.payload_from_proto(a.pull(completed=1).payloads[0])
    assert isinstance(mw, ModelWeights)
    np.testing.assert_array_equal(mw.tensors["w"], W["w"] * 2.5)


def test_too_many_elements(aggregator: Callable[..., Any], raw_client: Callable[..., RawClient]) -> None:
    agg = aggregator(run_config(), max_tensor_elements=4)
    a, b = raw_client(agg.port, "a"), raw_client(agg.port, "b")
    a.join(DECL)
    b.join(DECL)
    with pytest.raises(grpc.RpcError) as err:
        a.push(1, good())
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "5 tensor elements, the limit is 4" in err.value.details()


def _global(ins: apb.Instructions) -> dict[str, np.ndarray]:
    mw = codec.payload_from_proto(ins.payloads[0])
    assert isinstance(mw, ModelWeights)
    return mw.tensors


@pytest.mark.parametrize("policy", ["refuse", "clip"])
def test_an_update_far_from_the_global_model_is_refused_or_clipped(
        aggregator: Callable[..., Any], raw_client: Callable[..., RawClient], policy: str) -> None:
    """Round 2 starts from g = 2.5·W. An update at g + 20·g (distance 20·||g||, the bound 10·||g||) is refused
    and the round ends as without it, or clipped onto g + 10·g."""
    agg = aggregator(run_config(rounds=3, algorithm_config={"update_norm_policy": policy}))
    a, b = raw_client(agg.port, "a"), raw_client(agg.port, "b")
    a.join(DECL)
    b.join(DECL)
    a.pull()
    finish_round_and_check(a, b)
    g = {k: v * np.float32(2.5) for k, v in W.items()}
    far = [ModelWeights({k: v * np.float32(21) for k, v in g.items()}, 10),
           EvalMetrics(train_loss=0.5, test_accuracy=0.9, num_test_examples=5)]
    honest = [ModelWeights({k: v * np.float32(2) for k, v in g.items()}, 30),
              EvalMetrics(train_loss=0.5, test_accuracy=0.9, num_test_examples=5)]
    if policy == "refuse":
        with pytest.raises(grpc.RpcError) as err:
            a.push(2, far)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith("implausible_update: the update is ")
        assert "at most 10 times that (max_update_norm_ratio)" in err.value.details()
        assert rejected(agg, "implausible_update") == 1
        # Within the bound: 2·g is ||g|| away.
        a.push(2, [ModelWeights({k: v * np.float32(3) for k, v in g.items()}, 10), far[1]])
        b.push(2, honest)
        got = _global(a.pull(completed=2))
        for k, v in g.items():  # (10·3g + 30·2g) / 40 = 2.25·g, exactly in float32 for these values
            np.testing.assert_array_equal(got[k], (v.astype(np.float64) * 2.25).astype(np.float32))
    else:
        a.push(2, far)
        b.push(2, honest)
        got = _global(a.pull(completed=2))
        for k, v in g.items():  # a clipped onto g + 10·g = 11·g: (10·11g + 30·2g) / 40 = 4.25·g
            np.testing.assert_allclose(got[k], v.astype(np.float64) * 4.25, rtol=1e-6)
        assert rejected(agg, "implausible_update") == 0


def test_the_checks_are_per_run_options(aggregator: Callable[..., Any], raw_client: Callable[..., RawClient]) -> None:
    """Turned off, the same values are accepted (the run owner's choice, e.g. a figure that is not a fraction)."""
    agg = aggregator(run_config(check_metric_domains=False, max_examples=10**9,
                                algorithm_config={"max_abs_weight": 0}))
    a, b = raw_client(agg.port, "a"), raw_client(agg.port, "b")
    a.join(DECL)
    b.join(DECL)
    a.pull()
    assert a.push(1, [ModelWeights({"w": np.array([1e30, 0, 0], np.float32), "b": W["b"]}, 10**9),
                      EvalMetrics(test_accuracy=-3.0)]).accepted


def test_weights_can_be_the_declared_counts(aggregator: Callable[..., Any], raw_client: Callable[..., RawClient]) -> None:
    """example_weights = "declared": declarations of 10 and 30 weigh 10 and 30 whatever the updates claim (1 and
    30 here), so the model is 2.5·W as in finish_round_and_check; an organization that declared nothing is
    refused until it declares."""
    agg = aggregator(run_config(example_weights="declared"))
    a, b = raw_client(agg.port, "a"), raw_client(agg.port, "b")
    a.join(DECL, examples=10)
    b.join(DECL)
    a.pull()
    with pytest.raises(grpc.RpcError) as err:
        b.push(1, good(3.0, 5))
    assert err.value.details().startswith("invalid_value: run 'r' weighs updates by the training examples declared")
    assert rejected(agg, "invalid_value") == 1
    b.join(DECL, examples=30)
    a.push(1, good(1.0, 1))
    b.push(1, good(3.0, 30))
    got = _global(a.pull(completed=1))
    for k, v in W.items():
        np.testing.assert_array_equal(got[k], v * 2.5)
