"""A waiting client costs no thread; waits are validated and bounded; stops are bounded.

Long-polls are held open from one asyncio thread of the test (a grpc.aio channel), so the test's own thread
count does not grow with them either.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hetfed.v1 import aggregator_pb2 as apb
from hetfed.wire.payloads import EvalMetrics
from tests.conftest import RawClient, run_config, wait_until

Start = Callable[..., Any]
Clients = Callable[..., RawClient]
PULL = "/hetfed.v1.Aggregator/PullInstructions"


class HeldPolls:
    """``n`` long-polls of organizations o0..o(n-1), held open from one event-loop thread until closed."""

    def __init__(self, port: int, orgs: list[str], completed: int, wait: float) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.results: list[Any] = []

        async def open_all() -> grpc.aio.Channel:
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
            for org in orgs:
                req = apb.PullInstructionsRequest(run_id="r", organization_id=org, completed_round=completed,
                                                  wait_seconds=wait).SerializeToString()
                call = channel.unary_stream(PULL)(req, metadata=(("x-hetfed-organization", org),), timeout=wait + 30)
                self._loop.create_task(self._drain(call))
            return channel

        self._channel = asyncio.run_coroutine_threadsafe(open_all(), self._loop).result(10)

    async def _drain(self, call: Any) -> None:
        try:
            self.results.append([r async for r in call])
        except grpc.aio.AioRpcError as err:
            self.results.append(err.code())
        except asyncio.CancelledError:
            self.results.append("cancelled")

    def close(self) -> None:
        """Cancel every poll (the client gives up) and stop the thread."""
        asyncio.run_coroutine_threadsafe(self._channel.close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


@contextmanager
def held(port: int, orgs: list[str], completed: int = 1, wait: float = 25.0) -> Iterator[HeldPolls]:
    polls = HeldPolls(port, orgs, completed, wait)
    try:
        yield polls
    finally:
        polls.close()


def metrics(acc: float = 0.5) -> list[Any]:
    return [EvalMetrics(test_accuracy=acc, num_test_examples=1)]


def health_latency(port: int, times: int = 5) -> float:
    """The slowest of ``times`` health checks, in seconds."""
    worst = 0.0
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for _ in range(times):
            t0 = time.perf_counter()
            resp = stub.Check(health_pb2.HealthCheckRequest(service="hetfed.v1.Aggregator"), timeout=5)
            worst = max(worst, time.perf_counter() - t0)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
    return worst


def threads_now() -> int:
    """Python threads other than the worker pool's (which grows to ``worker_threads`` on demand, then stays)."""
    workers = [t for t in threading.enumerate() if t.name.startswith("hetfed-work")]
    assert len(workers) <= 4
    return threading.active_count() - len(workers)


def test_7_long_polls_hold_no_thread_and_nothing_queues_behind_them(aggregator: Start, raw_client: Clients) -> None:
    orgs = [f"o{i}" for i in range(200)]
    agg = aggregator(run_config(algorithm="local", organizations=[*orgs, "last", "other"]))
    clients = {o: raw_client(agg.port, o) for o in [*orgs, "last", "other"]}
    for o, c in clients.items():
        c.join()
        if o in orgs:
            c.push(1, metrics())  # now each one long-polls for round 2, which waits for "last"
    run = agg.service.runs["r"]
    with held(agg.port, orgs[:40]):  # more long-polls than the old server's 32 worker threads
        wait_until(lambda: run.notifier.waiting == 40, timeout=20, what="40 long-polls to wait")
        with_40 = threads_now()
        with held(agg.port, orgs[40:]):
            wait_until(lambda: run.notifier.waiting == 200, timeout=30, what="200 long-polls to wait")
            with_200 = threads_now() - 1  # minus the second HeldPolls' own loop thread
            assert with_200 == with_40  # the aggregator's threads do not depend on its waiting clients
            assert health_latency(agg.port) < 0.5  # health checks do not queue behind long-polls
            t0 = time.monotonic()
            clients["other"].push(1, metrics())  # neither do pushes
            assert time.monotonic() - t0 < 2.0
            clients["last"].push(1, metrics())  # completes the round: every waiting poll is answered
            wait_until(lambda: run.notifier.waiting == 0, timeout=20, what="the round close to wake every poll")
    assert agg.service.runs["r"].round == 2


def test_7_a_client_that_gives_up_frees_its_wait_at_once(aggregator: Start, raw_client: Clients) -> None:
    agg = aggregator(run_config(algorithm="local"))
    a = raw_client(agg.port, "a")
    raw_client(agg.port, "b").join()
    a.join()
    a.push(1, metrics())
    run = agg.service.runs["r"]
    polls = HeldPolls(agg.port, ["a"] * 10, completed=1, wait=25.0)
    wait_until(lambda: run.notifier.waiting == 10, timeout=10, what="10 long-polls to wait")
    t0 = time.monotonic()
    polls.close()
    wait_until(lambda: run.notifier.waiting == 0, timeout=5, what="the cancelled long-polls to end")
    assert time.monotonic() - t0 < 2.0  # not the remaining 25 s


def test_7_a_graceful_stop_ends_in_bounded_time_with_long_polls_waiting(aggregator: Start,
                                                                         raw_client: Clients) -> None:
    agg = aggregator(run_config(algorithm="local"))
    a = raw_client(agg.port, "a")
    raw_client(agg.port, "b").join()
    a.join()
    a.push(1, metrics())
    with held(agg.port, ["a"] * 20, wait=25.0) as polls:
        wait_until(lambda: agg.service.runs["r"].notifier.waiting == 20, timeout=10, what="20 long-polls")
        t0 = time.monotonic()
        agg.stop(grace=2.0)
        assert time.monotonic() - t0 < 3.0
        wait_until(lambda: len(polls.results) == 20, timeout=5, what="every poll to be answered")
    # Answered WAIT at once (the clients come back to the restarted aggregator), not cut off.
    for r in polls.results:
        assert isinstance(r, list) and apb.Instructions.FromString(b"".join(
            apb.PullInstructionsResponse.FromString(x).chunk.data for x in r)).action == apb.ACTION_WAIT


@pytest.mark.parametrize("wait", [math.nan, -1.0, math.inf, -math.inf])
def test_8_a_wait_that_is_not_a_finite_number_at_least_zero_is_refused(aggregator: Start, raw_client: Clients,
                                                                       wait: float) -> None:
    agg = aggregator(run_config(algorithm="local"))
    a = raw_client(agg.port, "a")
    a.join()
    req = apb.PullInstructionsRequest(run_id="r", organization_id="a", completed_round=-1, wait_seconds=wait)
    with pytest.raises(grpc.RpcError) as err:
        list(a.stub.PullInstructions(req, metadata=a.metadata, timeout=5))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("malformed: wait_seconds must be a finite number >= 0")


def test_8_a_huge_wait_is_bounded_by_the_server(aggregator: Start, raw_client: Clients) -> None:
    agg = aggregator(run_config(algorithm="local"), max_pull_wait_seconds=0.5)
    a = raw_client(agg.port, "a")
    raw_client(agg.port, "b").join()
    a.join()
    a.push(1, metrics())
    req = apb.PullInstructionsRequest(run_id="r", organization_id="a", completed_round=1, wait_seconds=1e300)
    t0 = time.monotonic()
    chunks = list(a.stub.PullInstructions(req, metadata=a.metadata, timeout=10))
    assert time.monotonic() - t0 < 3.0
    assert apb.Instructions.FromString(chunks[0].chunk.data).action == apb.ACTION_WAIT


def test_woken_long_polls_are_released_a_batch_per_loop_iteration() -> None:
    """``ChangeNotifier.notify`` wakes WAKE_BATCH waiters per event-loop iteration, so callbacks queued meanwhile (a
    health check, a push's next chunk) run between batches instead of after all of them; every waiter wakes."""
    from hetfed.aggregator.run.notifier import WAKE_BATCH, ChangeNotifier, _wake_batches

    async def batches() -> list[int]:
        loop = asyncio.get_running_loop()
        futs = [loop.create_future() for _ in range(2 * WAKE_BATCH + 5)]
        _wake_batches(futs)
        done = [sum(f.done() for f in futs)]
        while done[-1] < len(futs):
            await asyncio.sleep(0)  # one iteration
            done.append(sum(f.done() for f in futs))
        return done

    assert asyncio.run(batches()) == [WAKE_BATCH, 2 * WAKE_BATCH, 2 * WAKE_BATCH + 5]

    async def everyone() -> int:
        changes = ChangeNotifier()
        n = 3 * WAKE_BATCH + 5
        woken: list[int] = []

        async def waiter(i: int) -> None:
            await changes.wait(0, timeout=30)
            woken.append(i)

        tasks = [asyncio.create_task(waiter(i)) for i in range(n)]
        while changes.waiting < n:
            await asyncio.sleep(0)
        changes.notify()
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=10)
        return len(woken)

    assert asyncio.run(everyone()) == 3 * WAKE_BATCH + 5
