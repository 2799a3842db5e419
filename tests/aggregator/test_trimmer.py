"""The allocator trim after refused pushes: when it runs relative to the requests (a fake trim, real threads)."""

from __future__ import annotations

import threading
import time

from hetfed.aggregator.serving.memory import Trimmer
from tests.conftest import wait_until


def _recording(t: Trimmer) -> list[float]:
    calls: list[float] = []
    lock = threading.Lock()

    def trim(_pad: int) -> int:
        with lock:
            calls.append(time.monotonic())
        return 1

    t._trim = trim
    return calls


def test_the_trim_waits_the_delay_after_the_last_request_of_a_burst() -> None:
    """A push that ends while the trim of an earlier one waits must be trimmed too, after its buffers are freed:
    the trim comes `delay` after the burst's last request, not after its first."""
    # The gap between the two requests (0.15 s) is far under the delay (1 s), so a loaded machine that
    # oversleeps the gap still sends the second request inside the first one's wait.
    t = Trimmer(delay=1.0, interval=5.0)
    calls = _recording(t)
    t.request()
    time.sleep(0.15)
    last = time.monotonic()
    t.request()
    wait_until(lambda: len(calls) >= 1, timeout=10.0, what="the burst's trim")
    assert calls[0] - last >= 1.0 - 0.02
    time.sleep(0.5)
    assert len(calls) == 1  # one trim for the burst


def test_a_stream_of_requests_is_still_trimmed_within_the_interval() -> None:
    t = Trimmer(delay=0.3, interval=0.6)
    calls = _recording(t)
    start = time.monotonic()
    stop = threading.Event()

    def spam() -> None:
        while not stop.is_set():
            t.request()
            time.sleep(0.05)

    th = threading.Thread(target=spam)
    th.start()
    try:
        wait_until(lambda: len(calls) >= 1, timeout=5.0, what="a trim during the stream")
    finally:
        stop.set()
        th.join()
    assert calls[0] - start < 0.6 + 0.3  # cut short at the interval, not postponed for ever
    ended = time.monotonic()
    wait_until(lambda: calls[-1] >= ended, timeout=10.0, what="the trim owed after the cut")  # the requests after the cut still get their trim
