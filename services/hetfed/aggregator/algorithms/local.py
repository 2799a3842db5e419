"""Local training's server half: nothing to aggregate, nothing to send (every hook is the base's no-op)."""

from __future__ import annotations

from hetfed.aggregator.algorithms.base import ServerHalf
from hetfed.wire.specs import local
from hetfed.wire.specs.local import LocalConfig


@local.SPEC.server_half
class LocalServer(ServerHalf[LocalConfig]):
    """Local training: organizations only report metrics."""
