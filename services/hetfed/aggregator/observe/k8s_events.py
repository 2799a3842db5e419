"""Kubernetes Events about the aggregator's own pod (round closes, rejections), recorded without blocking.

Inside a cluster (``KUBERNETES_SERVICE_HOST`` set, a service-account token mounted, ``POD_NAME`` given by
the downward API) the ``hetfed aggregator`` process installs an :class:`EventRecorder`; the round engine
and the servicer call :func:`emit`, which only puts the event in a bounded queue. A background thread
posts it as an ``events.k8s.io/v1`` Event whose ``regarding`` is the pod, so ``kubectl describe pod``
and ``kubectl get events`` show the federation's progress. Bursts are limited per reason (a token
bucket); suppressed events are counted and the next one of that reason says how many. Outside a cluster
nothing is installed, :func:`emit` does nothing, and one log line says so. ``kubernetes`` is imported
only when a recorder is built, so a local run never loads it.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("hetfed.aggregator.events")

SERVICEACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
# Set to "off" (the chart's aggregator.events.enabled=false) to record no Events even inside a cluster.
EVENTS_ENV = "HETFED_EVENTS"
REPORTING_CONTROLLER = "hetfed.io/aggregator"
# The API server refuses an Event whose note is longer than 1 kB.
MAX_NOTE_BYTES = 1024
ACTIONS = {"RoundClosed": "CloseRound", "Rejected": "Reject"}


@dataclass(frozen=True)
class PodRef:
    """The pod the Events are about: the aggregator's own."""

    name: str
    namespace: str
    uid: str = ""


@dataclass
class _Bucket:
    tokens: float
    updated: float
    suppressed: int = 0


class EventRecorder:
    """Posts Events from a background thread; :meth:`record` never blocks and never raises."""

    def __init__(
        self,
        api_client: Any,
        pod: PodRef,
        *,
        max_queue: int = 256,
        burst: int = 25,
        refill_seconds: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.api_client = api_client
        # Some client versions send no Content-Type on create; the API server then has to guess.
        api_client.set_default_header("Content-Type", "application/json")
        self.pod = pod
        self.burst = burst
        self.refill_seconds = refill_seconds
        self.clock = clock
        self.dropped = 0  # events lost because the queue was full
        self.failed = 0  # events the API server refused or did not answer
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue(maxsize=max_queue)
        self._buckets: dict[str, _Bucket] = {}
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="hetfed-k8s-events", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ producer side
    def _admit(self, reason: str) -> int | None:
        """Take a token of ``reason``'s bucket: the number of events suppressed since the last one, or None."""
        now = self.clock()
        with self._lock:
            b = self._buckets.setdefault(reason, _Bucket(float(self.burst), now))
            b.tokens = min(float(self.burst), b.tokens + (now - b.updated) / self.refill_seconds)
            b.updated = now
            if b.tokens < 1.0:
                b.suppressed += 1
                return None
            b.tokens -= 1.0
            suppressed, b.suppressed = b.suppressed, 0
            return suppressed

    def record(self, reason: str, note: str, *, warning: bool = False, action: str | None = None) -> bool:
        """Queue an Event about the pod; False when it was rate-limited or the queue was full."""
        suppressed = self._admit(reason)
        if suppressed is None:
            return False
        if suppressed:
            note = f"{note} ({suppressed} similar events suppressed)"
        encoded = note.encode()
        if len(encoded) > MAX_NOTE_BYTES:
            note = encoded[: MAX_NOTE_BYTES - 3].decode(errors="ignore") + "..."
        item = {
            "reason": reason,
            "note": note,
            "type": "Warning" if warning else "Normal",
            "action": action or ACTIONS.get(reason, reason),
            "time": dt.datetime.now(dt.UTC),
        }
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 100 == 0:
                log.warning("Kubernetes Event queue full: %d events dropped so far", self.dropped)
            return False
        return True

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every queued Event was posted (or failed); False on timeout."""
        deadline = time.monotonic() + timeout
        with self._queue.all_tasks_done:
            while self._queue.unfinished_tasks:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._queue.all_tasks_done.wait(remaining)
        return True

    def close(self, timeout: float = 2.0) -> None:
        """Post what is queued (for at most ``timeout`` seconds), then stop the thread."""
        self.flush(timeout)
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            return
        self._thread.join(timeout)

    # ------------------------------------------------------------------ consumer side
    def body(self, item: Mapping[str, Any]) -> dict[str, Any]:
        """The events.k8s.io/v1 Event for a queued item (named like client-go: ``<pod>.<hex nanoseconds>``)."""
        when: dt.datetime = item["time"]
        regarding: dict[str, str] = {
            "apiVersion": "v1", "kind": "Pod", "name": self.pod.name, "namespace": self.pod.namespace,
        }
        if self.pod.uid:
            regarding["uid"] = self.pod.uid
        return {
            "apiVersion": "events.k8s.io/v1",
            "kind": "Event",
            "metadata": {"name": f"{self.pod.name}.{time.time_ns():x}", "namespace": self.pod.namespace},
            "eventTime": when.strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
            "reportingController": REPORTING_CONTROLLER,
            "reportingInstance": self.pod.name[:128],
            "action": item["action"],
            "reason": item["reason"],
            "type": item["type"],
            "note": item["note"],
            "regarding": regarding,
        }

    def _post(self, item: Mapping[str, Any]) -> None:
        from kubernetes import client

        body: Any = self.body(item)  # a plain mapping: the client serializes it as it is
        client.EventsV1Api(self.api_client).create_namespaced_event(self.pod.namespace, body)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._post(item)
            except Exception as exc:  # an unreachable or refusing API server must not stop the aggregator
                self.failed += 1
                if self.failed == 1 or self.failed % 100 == 0:
                    log.warning("could not record a Kubernetes Event (%d failures so far): %s", self.failed,
                                str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            finally:
                self._queue.task_done()

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_environment(
        cls, environ: Mapping[str, str] | None = None, serviceaccount_dir: Path = SERVICEACCOUNT_DIR
    ) -> EventRecorder | None:
        """A recorder for this pod when running in a cluster; None (and one log line saying why) otherwise."""
        env = os.environ if environ is None else environ
        if env.get(EVENTS_ENV, "on").lower() in ("off", "0", "false", "no"):
            log.info("Kubernetes Events are off (%s=%s)", EVENTS_ENV, env[EVENTS_ENV])
            return None
        token = serviceaccount_dir / "token"
        if not env.get("KUBERNETES_SERVICE_HOST") or not token.is_file():
            log.info("not running in a Kubernetes cluster (no KUBERNETES_SERVICE_HOST or no service-account "
                     "token in %s): Kubernetes Events are off", serviceaccount_dir)
            return None
        pod_name = env.get("POD_NAME", "")
        namespace = env.get("POD_NAMESPACE", "")
        if not namespace and (serviceaccount_dir / "namespace").is_file():
            namespace = (serviceaccount_dir / "namespace").read_text().strip()
        if not pod_name or not namespace:
            log.warning("in a Kubernetes cluster but POD_NAME or POD_NAMESPACE is not set (the chart sets them "
                        "from the downward API): Kubernetes Events are off")
            return None
        try:
            from kubernetes import client
            from kubernetes.config.incluster_config import InClusterConfigLoader
        except ImportError:
            log.warning("in a Kubernetes cluster but the kubernetes package is not installed "
                        "(pip install 'hetfed[kubernetes]'): Kubernetes Events are off")
            return None
        configuration = client.Configuration()
        try:
            InClusterConfigLoader(str(token), str(serviceaccount_dir / "ca.crt"), environ=env).load_and_set(
                configuration
            )
        except Exception as exc:
            log.warning("cannot load the in-cluster Kubernetes configuration (%s): Kubernetes Events are off", exc)
            return None
        pod = PodRef(pod_name, namespace, env.get("POD_UID", ""))
        log.info("recording Kubernetes Events about pod %s/%s", namespace, pod_name)
        return cls(client.ApiClient(configuration), pod)


# The process's recorder: Events are about this process's pod, so there is one per process.
_recorder: EventRecorder | None = None


def install(recorder: EventRecorder | None) -> None:
    """Make ``recorder`` the one :func:`emit` uses (None: emit nothing); closes the one it replaces."""
    global _recorder
    previous, _recorder = _recorder, recorder
    if previous is not None and previous is not recorder:
        previous.close()


def emit(reason: str, note: str, *, warning: bool = False) -> None:
    """Record an Event about this pod if a recorder is installed; never blocks, never raises."""
    recorder = _recorder
    if recorder is not None:
        recorder.record(reason, note, warning=warning)


def start_from_environment() -> None:
    """Install a recorder when running in a cluster (the ``hetfed aggregator`` process calls this once)."""
    install(EventRecorder.from_environment())


def shutdown(timeout: float = 2.0) -> None:
    """Post the queued Events (for at most ``timeout`` seconds) and uninstall the recorder."""
    global _recorder
    recorder, _recorder = _recorder, None
    if recorder is not None:
        recorder.close(timeout)
