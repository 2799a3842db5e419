"""The client runtime: join, long-poll for instructions, run the algorithm's hook, push; retry with backoff."""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import grpc
import numpy as np
from prometheus_client import CollectorRegistry, Gauge, start_http_server

from hetfed.client.config import ClientConfig
from hetfed.v1 import aggregator_pb2 as apb
from hetfed.v1 import aggregator_pb2_grpc as agrpc
from hetfed.wire import chunks, codec, contract
from hetfed.wire.config import from_mapping
from hetfed.wire.payloads import RELAYED_KINDS, EvalMetrics, Payload, PayloadKind, by_kind
from hetfed.wire.specs import AlgorithmSpec, get_spec
from hetfed.wire.traffic import TrafficBreakdown, TrafficMetrics, breakdown
from hetfed.wire.transport import ORGANIZATION_METADATA_KEY, make_channel

log = logging.getLogger("hetfed.client")
T = TypeVar("T")

# Failures worth retrying: the aggregator is restarting, unreachable or overloaded.
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED,
             grpc.StatusCode.ABORTED, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}


class ClientError(RuntimeError):
    """The aggregator refused this client for a reason retrying cannot fix."""


def backoff_delays(initial: float, maximum: float, multiplier: float, rng: random.Random) -> Iterator[float]:
    """Exponential backoff with full jitter: uniform(0, min(max, initial·multiplier^k))."""
    cap = initial
    while True:
        yield rng.uniform(0, cap)
        cap = min(maximum, cap * multiplier)


def resolve_device(name: str) -> str:
    """The torch device for a config value ("auto" picks CUDA when present)."""
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ClientError(f"device {name!r} requested but CUDA is not available here")
    return name


class ClientRuntime:
    """One organization's participation in one run, over real gRPC."""

    def __init__(self, config: ClientConfig, registry: CollectorRegistry | None = None) -> None:
        self.config = config
        self.registry = registry or CollectorRegistry()
        self.traffic = TrafficMetrics(self.registry, "client")
        self.train_loss = Gauge("hetfed_client_train_loss", "Training loss of the last round",
                                ["run", "algorithm", "organization"], registry=self.registry)
        self.test_accuracy = Gauge("hetfed_client_test_accuracy", "Test accuracy reported in the last round",
                                   ["run", "algorithm", "organization"], registry=self.registry)
        self.round_gauge = Gauge("hetfed_client_round", "Last round this organization completed",
                                 ["run", "algorithm", "organization"], registry=self.registry)
        self._rng = random.Random(config.data.seed * 7919 + len(config.organization))
        self._channel = make_channel(config.aggregator, config.tls)
        self._stub = agrpc.AggregatorStub(self._channel)
        self._metadata = (() if config.tls else ((ORGANIZATION_METADATA_KEY, config.organization),))
        self.spec: AlgorithmSpec | None = None
        self.algorithm = ""
        self.reports: list[tuple[int, EvalMetrics]] = []

    # ------------------------------------------------------------------ retries
    def _retry(self, what: str, call: Callable[[], T]) -> T:
        r = self.config.retry
        delays = backoff_delays(r.initial_backoff_seconds, r.max_backoff_seconds, r.multiplier, self._rng)
        start = time.monotonic()
        while True:
            try:
                return call()
            except grpc.RpcError as err:
                code = err.code()  # type: ignore[attr-defined]
                details = err.details() or ""  # type: ignore[attr-defined]
                permanent = code == grpc.StatusCode.RESOURCE_EXHAUSTED and not details.startswith("rate_limited")
                if code not in RETRYABLE or permanent:
                    raise ClientError(f"{what} refused: {code.name}: {err.details()}") from None  # type: ignore[attr-defined]
                if time.monotonic() - start > r.give_up_after_seconds:
                    raise ClientError(f"{what}: aggregator unreachable for {r.give_up_after_seconds:.0f}s "
                                      f"({code.name}: {err.details()})") from None  # type: ignore[attr-defined]
                delay = next(delays)
                log.info("%s failed (%s); retrying in %.2fs", what, code.name, delay)
                time.sleep(delay)

    # ------------------------------------------------------------------ RPCs
    def _join(self, declared: list[tuple[PayloadKind, str, np.ndarray]],
              seed_set: apb.DatasetFingerprint | None) -> apb.JoinResponse:
        req = apb.JoinRequest(
            run_id=self.config.run,
            organization_id=self.config.organization,
            num_train_examples=0,
        )
        if seed_set is not None:
            req.seed_set.CopyFrom(seed_set)
        wire_dtype = self._wire_dtype
        for kind, name, arr in declared:
            dt = wire_dtype if (wire_dtype and arr.dtype.kind == "f") else codec.wire_dtype_of(arr)
            req.declared_tensors.add(payload_kind=kind.proto_enum, name=name,  # type: ignore[arg-type]
                                     dtype=codec._WIRE[dt][0], shape=arr.shape)  # type: ignore[arg-type]
        resp = self._retry("Join", lambda: self._stub.Join(req, metadata=self._metadata, timeout=30))
        self._count("up", breakdown([], req.ByteSize()))
        self._count("down", breakdown([], resp.ByteSize()))
        return resp

    def _count(self, direction: str, b: TrafficBreakdown) -> None:
        self.traffic.record(self.config.run, self.algorithm or "unknown", self.config.organization, direction, b)

    def _pull(self, completed: int) -> apb.Instructions:
        req = apb.PullInstructionsRequest(run_id=self.config.run, organization_id=self.config.organization,
                                          completed_round=completed, wait_seconds=self.config.pull_wait_seconds)

        def call() -> tuple[bytes, int, int]:
            asm = chunks.Reassembler(max_bytes=1 << 40)
            wire, n = 0, 0
            for resp in self._stub.PullInstructions(req, metadata=self._metadata,
                                                    timeout=self.config.pull_wait_seconds + 60):
                wire += resp.ByteSize()
                n += 1
                asm.add(resp.chunk)
            return asm.data(), wire, n

        data, wire, n = self._retry("PullInstructions", call)
        ins = apb.Instructions.FromString(data)
        self._count("up", breakdown([], req.ByteSize()))
        self._count("down", breakdown(list(ins.payloads), wire, n))
        return ins

    def _push(self, round_: int, payloads: list[Payload]) -> apb.PushUpdateResponse | None:
        update = apb.Update(
            envelope=apb.Envelope(run_id=self.config.run, round=round_, organization_id=self.config.organization,
                                  payload_kinds=[p.kind.proto_enum for p in payloads]),  # type: ignore[misc]
        )
        for p in payloads:
            codec.fill_payload(update.payloads.add(), p, self._wire_dtype)  # in place: no extra tensor copy
        messages = update.payloads
        data = update.SerializeToString()
        requests = [apb.PushUpdateRequest(run_id=self.config.run, round=round_,
                                          organization_id=self.config.organization, chunk=c)
                    for c in chunks.split(data)]

        def call() -> apb.PushUpdateResponse:
            return self._stub.PushUpdate(iter(requests), metadata=self._metadata, timeout=600)

        try:
            resp = self._retry("PushUpdate", call)
        except ClientError as err:
            if "FAILED_PRECONDITION" in str(err):
                log.warning("round %d closed before our update arrived: %s", round_, err)
                return None
            raise
        if not resp.duplicate:
            self._count("up", breakdown(messages, sum(r.ByteSize() for r in requests), len(requests)))
            self._count("down", breakdown([], resp.ByteSize()))
        return resp

    # ------------------------------------------------------------------ main loop
    @property
    def _wire_dtype(self) -> str | None:
        if self.spec is None:
            return None
        return None if self._train_config.wire_dtype == "float32" else self._train_config.wire_dtype

    def run(self) -> list[tuple[int, EvalMetrics]]:
        """Take part in the run until it finishes; returns the metrics reported per round."""
        import torch

        from hetfed.client.algorithms import ClientContext, make_client_half
        from hetfed.client.data import load_client_data
        from hetfed.client.models import SplitModel, build_model

        cfg = self.config
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        if cfg.metrics_port >= 0:
            start_http_server(cfg.metrics_port, addr=cfg.metrics_host, registry=self.registry)
        device = torch.device(resolve_device(cfg.device))
        data = load_client_data(cfg.data)
        # Learn the algorithm and seed first: the model's initial weights come from the run seed.
        probe = self._retry("Status", lambda: self._stub.Status(apb.StatusRequest(run_id=cfg.run),
                                                                metadata=self._metadata, timeout=30))
        self.algorithm = probe.runs[0].algorithm
        self.spec = get_spec(self.algorithm)
        latent = cfg.model.latent_dim or None
        bounded = self.spec.bounded_latent

        def build(seed: int) -> SplitModel:
            return build_model(cfg.model.name, data.input_shape, data.num_classes, seed=seed, latent_dim=latent,
                               bounded_latent=bounded).to(device)

        # The declaration depends only on shapes, so a model built with seed 0 describes it.
        self._train_config = self.spec.config_type()
        ctx = ClientContext(cfg.organization, build(0), data, device, self._train_config, 0)
        joined = self._join(make_client_half(self.algorithm, ctx).declared(), self._seed_set(data))
        train_config = from_mapping(self.spec.config_type, json.loads(joined.algorithm_config_json),
                                    f"runs[{cfg.run}].algorithm_config")
        self._train_config = train_config
        # The run's seed fixes the initial weights; the data stays where it was copied to the device, once.
        ctx.model, ctx.config, ctx.seed = build(int(joined.seed)), train_config, int(joined.seed)
        half = make_client_half(self.algorithm, ctx)
        log.info("%s joined run %s (%s) at round %d on %s", cfg.organization, cfg.run, self.algorithm,
                 joined.current_round, device)
        labels = (cfg.run, self.algorithm, cfg.organization)
        completed = -1
        while True:
            ins = self._pull(completed)
            action, round_ = ins.action, ins.envelope.round
            if action == apb.ACTION_WAIT:
                continue
            if action == apb.ACTION_FINISH:
                log.info("%s: run %s finished", cfg.organization, cfg.run)
                break
            received = by_kind(contract.check_download(self.spec, ins.payloads), repeated=RELAYED_KINDS)
            if action == apb.ACTION_SETUP:
                upload = half.setup(ins.round_seed)
            elif action == apb.ACTION_TRAIN:
                upload = half.train(round_, ins.round_seed, received)
            elif action == apb.ACTION_EVALUATE:
                upload = [half.evaluate(round_, received)]
            else:
                raise ClientError(f"unknown action {action} in instructions for round {round_}")
            self._push(round_, upload)
            if cfg.output_dir and (action == apb.ACTION_EVALUATE or (action == apb.ACTION_TRAIN and round_ == 1)):
                from hetfed.client.artifacts import write_snapshot

                tag = "final" if action == apb.ACTION_EVALUATE else "round-1"
                write_snapshot(cfg.output_dir, tag, ctx.model, data, cfg.model.name)
            completed = round_
            for p in upload:
                if isinstance(p, EvalMetrics):
                    self.reports.append((round_, p))
                    self.train_loss.labels(*labels).set(p.train_loss)
                    self.test_accuracy.labels(*labels).set(p.test_accuracy)
            self.round_gauge.labels(*labels).set(round_)
        self._channel.close()
        if cfg.metrics_port >= 0 and cfg.metrics_linger_seconds > 0:
            time.sleep(cfg.metrics_linger_seconds)  # serve the final counts to the next scrape
        return self.reports

    def _seed_set(self, data: object) -> apb.DatasetFingerprint | None:
        """The seed-set fingerprint a data set carries (FedH2L); None otherwise."""
        fp = getattr(data, "seed_set", None)
        if fp is None:
            return None
        return apb.DatasetFingerprint(id=fp[0], sha256=fp[1])
