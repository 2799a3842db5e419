"""Limits answered with a clear status and a counted rejection: request rate, update size, anonymity."""

from __future__ import annotations

import time

import grpc
import pytest

from hetfed.cli.certs import FederationCerts
from hetfed.v1 import aggregator_pb2 as apb
from hetfed.v1 import aggregator_pb2_grpc as agrpc
from hetfed.wire.transport import ORGANIZATION_METADATA_KEY, TlsConfig, make_channel

from .conftest import RUN, AggregatorFactory, join, rejected

RATE = 5.0  # requests per second; the bucket holds 2 * RATE


def _hammer(channel: grpc.Channel, organization: str | None, calls: int = 50) -> tuple[int, list[grpc.RpcError]]:
    """``calls`` Joins as fast as one channel goes: (accepted, rejections)."""
    metadata = ((ORGANIZATION_METADATA_KEY, organization),) if organization else ()
    ok, errors = 0, []
    for _ in range(calls):
        try:
            join(channel, metadata=metadata)
            ok += 1
        except grpc.RpcError as err:
            errors.append(err)
    return ok, errors


def _join_eventually(channel: grpc.Channel, metadata: tuple[tuple[str, str], ...], timeout: float = 5.0) -> None:
    """Retry a Join until the bucket has refilled enough to admit it."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            join(channel, metadata=metadata)
            return
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
                raise
        time.sleep(1 / RATE)


def test_rate_limit_per_organization(start: AggregatorFactory) -> None:
    agg = start(max_requests_per_second=RATE)
    with grpc.insecure_channel(f"127.0.0.1:{agg.port}") as ch:
        t0 = time.monotonic()
        ok, errors = _hammer(ch, "org-a")
        elapsed = time.monotonic() - t0
        assert errors, "50 back-to-back requests at 5/s were all admitted"
        assert {e.code() for e in errors} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
        assert all(e.details().startswith("rate_limited: ") for e in errors)
        # A full bucket (2 * RATE) plus what refilled while hammering, never more.
        assert 1 <= ok <= 2 * RATE + elapsed * RATE + 1
        assert rejected(agg, "rate_limited") == len(errors)
        # Another organization has its own bucket.
        assert join(ch, metadata=((ORGANIZATION_METADATA_KEY, "org-b"),)).run_id == RUN
        # And the limited one is admitted again once its bucket refills.
        _join_eventually(ch, ((ORGANIZATION_METADATA_KEY, "org-a"),))


def test_unlimited_by_default(start: AggregatorFactory) -> None:
    agg = start()
    with grpc.insecure_channel(f"127.0.0.1:{agg.port}") as ch:
        ok, errors = _hammer(ch, "org-a", calls=30)
    assert (ok, errors) == (30, [])
    assert rejected(agg, "rate_limited") == 0


def test_rate_limit_applies_under_mtls(start: AggregatorFactory, certs: FederationCerts) -> None:
    agg = start(certs.aggregator_tls(), max_requests_per_second=RATE)
    tls: TlsConfig = certs.client_tls("org-a")
    with make_channel(f"127.0.0.1:{agg.port}", tls) as ch:
        _ok, errors = _hammer(ch, None)
    assert errors
    assert rejected(agg, "rate_limited") == len(errors)


def test_status_is_rate_limited_under_mtls_too(start: AggregatorFactory, certs: FederationCerts) -> None:
    agg = start(certs.aggregator_tls(), max_requests_per_second=RATE)
    with make_channel(f"127.0.0.1:{agg.port}", certs.client_tls("org-a")) as ch:
        stub = agrpc.AggregatorStub(ch)
        codes = []
        for _ in range(30):
            try:
                stub.Status(apb.StatusRequest(), timeout=10)
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as err:
                codes.append(err.code())
    assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes
    assert rejected(agg, "rate_limited", run="") == codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED)


def test_no_identity_is_unauthenticated(start: AggregatorFactory) -> None:
    agg = start()
    with grpc.insecure_channel(f"127.0.0.1:{agg.port}") as ch, pytest.raises(grpc.RpcError) as info:
        join(ch)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert info.value.details().startswith("unauthenticated: ")
    assert rejected(agg, "unauthenticated") == 1


def test_an_oversized_update_is_refused_before_it_is_read(start: AggregatorFactory) -> None:
    agg = start(max_update_bytes=4096)
    metadata = ((ORGANIZATION_METADATA_KEY, "org-a"),)
    with grpc.insecure_channel(f"127.0.0.1:{agg.port}") as ch:
        resp = join(ch, metadata=metadata)
        # The first chunk announces 1 MiB: refused on the announcement, whatever follows.
        first = apb.PushUpdateRequest(
            run_id=RUN, round=resp.current_round, organization_id="org-a",
            chunk=apb.Chunk(index=0, count=2, total_bytes=1 << 20, data=b"\0" * 1024),
        )
        with pytest.raises(grpc.RpcError) as info:
            agrpc.AggregatorStub(ch).PushUpdate(iter([first]), metadata=metadata, timeout=10)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert info.value.details().startswith("oversized: ")
    assert "4096" in info.value.details()
    assert rejected(agg, "oversized") == 1
