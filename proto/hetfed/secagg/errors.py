"""Typed refusals of the secure aggregation core: each names a reason a caller can count and report."""

from __future__ import annotations

# Why a stage was refused. A later wire layer maps each to a gRPC status; the core only names them.
REASONS = frozenset({
    "foreign_message",  # another run, round, sender or receiver than this session's
    "unexpected_stage",  # a message for a stage that is not the open one (a replay, or a late input)
    "duplicate",  # a second message of one stage from one sender
    "bad_keys",  # a public key of the wrong size, reused, or one that gives a degenerate agreement
    "neighbours_mismatch",  # a set of peers that is not the one the neighbourhood graph gives
    "share_authentication_failed",  # an encrypted share that does not open under its binding
    "both_shares_requested",  # an unmasking request asking a peer's self-mask share and key share at once
    "malformed",  # a vector or share of the wrong size or type
    "out_of_range",  # a value outside the declared range or norm bound, refused in strict mode
    "sum_out_of_range",  # an unmasked sum outside what the declared bounds allow
    "inconsistent_shares",  # Shamir shares that do not lie on one polynomial
    "bad_parameters",  # a configuration that could wrap around, or a threshold the graph cannot meet
    "below_threshold",  # fewer live parties than the threshold needs: the round is abandoned
})


class SecAggError(Exception):
    """A refused message or configuration; ``reason`` is one of REASONS."""

    def __init__(self, reason: str, detail: str) -> None:
        if reason not in REASONS:
            raise ValueError(f"unknown secure aggregation reason {reason!r}")
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class AbandonedError(SecAggError):
    """The round's secure aggregation cannot finish: too few parties are left to unmask the sum. Raised before
    anything that would reveal an input is asked for; ``stage`` names where it stopped."""

    def __init__(self, stage: str, detail: str) -> None:
        super().__init__("below_threshold", f"abandoned at {stage}: {detail}")
        self.stage = stage
