"""The throwaway algorithm's spec: its config and its wire contract (heads up and down, metrics up)."""

from __future__ import annotations

from dataclasses import dataclass

from hetfed.wire.config import check
from hetfed.wire.payloads import PayloadKind as K
from hetfed.wire.specs.base import AlgorithmSpec, Figure, TrainConfig


@dataclass(frozen=True)
class ShrinkConfig(TrainConfig):
    """Shrink: the global head is the mean of the heads times ``shrink``."""

    shrink: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.shrink >= 0, f"shrink must be >= 0, got {self.shrink}")


SPEC = AlgorithmSpec(
    name="throwaway_shrink",
    summary="Shrink (a test's throwaway): the mean of the heads times a factor.",
    config_type=ShrinkConfig,
    upload=frozenset({K.HEAD_WEIGHTS, K.EVAL_METRICS}),
    required_upload=frozenset({K.HEAD_WEIGHTS, K.EVAL_METRICS}),
    download=frozenset({K.HEAD_WEIGHTS}),
    model_private=True,
    figures=(Figure("received", "received_head_norm"),),
    server="tests.throwaway.server:ShrinkServer",
    client="tests.throwaway.client:ShrinkClient",
)
