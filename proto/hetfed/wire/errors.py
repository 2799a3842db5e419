"""Typed wire errors: each carries a rejection reason (a metric label) and the gRPC status it maps to."""

from __future__ import annotations

# Rejection reason -> gRPC status code name. One table, so every reason has exactly one status.
REASON_STATUS: dict[str, str] = {
    "malformed": "INVALID_ARGUMENT",
    "checksum_mismatch": "INVALID_ARGUMENT",
    "unsupported_dtype": "INVALID_ARGUMENT",
    "envelope_mismatch": "INVALID_ARGUMENT",
    "missing_payload": "INVALID_ARGUMENT",
    "duplicate_payload": "INVALID_ARGUMENT",
    "dtype_mismatch": "INVALID_ARGUMENT",
    "shape_mismatch": "INVALID_ARGUMENT",
    "schema_mismatch": "INVALID_ARGUMENT",
    "non_finite": "INVALID_ARGUMENT",
    "invalid_value": "INVALID_ARGUMENT",
    "seed_set_mismatch": "FAILED_PRECONDITION",
    "payload_kind_not_allowed": "PERMISSION_DENIED",
    "unknown_organization": "PERMISSION_DENIED",
    "identity_mismatch": "PERMISSION_DENIED",
    "unauthenticated": "UNAUTHENTICATED",
    "oversized": "RESOURCE_EXHAUSTED",
    "rate_limited": "RESOURCE_EXHAUSTED",
    "late": "FAILED_PRECONDITION",
    "not_joined": "FAILED_PRECONDITION",
    "replayed": "ALREADY_EXISTS",
    "unknown_run": "NOT_FOUND",
}


class WireError(Exception):
    """A message that breaks the wire contract; ``reason`` labels the rejection metric."""

    def __init__(self, reason: str, message: str) -> None:
        if reason not in REASON_STATUS:
            raise ValueError(f"unknown rejection reason {reason!r}")
        super().__init__(message)
        self.reason = reason
        self.message = message

    @property
    def status(self) -> str:
        """The gRPC status code name for this error."""
        return REASON_STATUS[self.reason]

    def __str__(self) -> str:
        return f"{self.reason}: {self.message}"
