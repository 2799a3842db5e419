"""Typed wire errors: each carries a rejection reason (a metric label), the gRPC status it maps to, and
whether a client should retry it. The reason travels to the client as a gRPC rich status (ErrorInfo), so
clients decide by reason, never by matching message text."""

from __future__ import annotations

from typing import NamedTuple

# The reason a client's leave notice is refused with: its organization's privacy budget would be exceeded by its next
# round, so it leaves the run (docs/privacy.md). The aggregator stops waiting for it in the open round at once.
PRIVACY_BUDGET_SPENT_REASON = "privacy_budget_spent"
# The reason any other leave notice is refused with: the organization leaves for the reason its notice gives (its
# local training diverged, for example). The aggregator stops waiting for it in the open round at once too.
ORGANIZATION_LEFT_REASON = "organization_left"
# The refusals of a leave notice: they release the open round as well as the later ones.
LEAVE_REASONS = frozenset({PRIVACY_BUDGET_SPENT_REASON, ORGANIZATION_LEFT_REASON})
# The longest leave reason the aggregator keeps (characters; the rest is cut), so that its refusal, which quotes
# it with the organization and run ids (63 characters at most each), fits in a reply's 512 characters.
MAX_LEAVE_REASON_CHARS = 256
# Longest rejection message sent back or logged: a request's strings are never echoed in full.
MAX_DETAIL_CHARS = 512


def clip(text: str, limit: int = MAX_DETAIL_CHARS) -> str:
    """``text`` cut to ``limit`` characters (with a marker), for replies and logs."""
    return text if len(text) <= limit else text[: limit - 12] + f"… (+{len(text) - limit + 12} chars)"


class Reason(NamedTuple):
    """How a rejection reason is answered."""

    status: str
    retryable: bool


# Rejection reason -> gRPC status code name and retryability. One table, so every reason has exactly one
# status; the client reads the same table to decide whether to retry.
REASONS: dict[str, Reason] = {
    "malformed": Reason("INVALID_ARGUMENT", False),
    "checksum_mismatch": Reason("INVALID_ARGUMENT", True),  # a corrupted transfer: sending again may succeed
    "unsupported_dtype": Reason("INVALID_ARGUMENT", False),
    "envelope_mismatch": Reason("INVALID_ARGUMENT", False),
    "missing_payload": Reason("INVALID_ARGUMENT", False),
    "duplicate_payload": Reason("INVALID_ARGUMENT", False),
    "dtype_mismatch": Reason("INVALID_ARGUMENT", False),
    "shape_mismatch": Reason("INVALID_ARGUMENT", False),
    "schema_mismatch": Reason("INVALID_ARGUMENT", False),
    "non_finite": Reason("INVALID_ARGUMENT", False),
    "invalid_value": Reason("INVALID_ARGUMENT", False),
    # Well-formed but implausible: an update beyond the run's bounds (max_abs_weight, its distance from the
    # global model), a figure outside its domain (an accuracy outside [0, 1], a negative loss).
    "implausible_update": Reason("INVALID_ARGUMENT", False),
    "implausible_metric": Reason("INVALID_ARGUMENT", False),
    # An update's privacy declaration out of its domain (a σ or C <= 0, a δ outside (0, 1), an unknown mechanism), or
    # with an ε below the organization's last accepted one (its client lost its privacy ledger).
    "invalid_privacy": Reason("INVALID_ARGUMENT", False),
    "privacy_regressed": Reason("INVALID_ARGUMENT", False),
    "seed_set_mismatch": Reason("FAILED_PRECONDITION", False),
    # The run requires differential privacy of every organization (require_privacy) and the update declares none.
    "privacy_required": Reason("FAILED_PRECONDITION", False),
    # The run refuses privacy ledgers that end with their client process (refuse_ephemeral_ledgers), and the
    # update's declaration says its ledger is one.
    "privacy_ephemeral_ledger": Reason("FAILED_PRECONDITION", False),
    # The update declares an ε above the run's max_epsilon.
    "privacy_epsilon_exceeded": Reason("FAILED_PRECONDITION", False),
    # A leave notice: the update's declaration says budget_spent (no payload; its organization leaves the run).
    PRIVACY_BUDGET_SPENT_REASON: Reason("FAILED_PRECONDITION", False),
    # A leave notice for another reason (Update.leave_reason: no payload; its organization leaves the run).
    ORGANIZATION_LEFT_REASON: Reason("FAILED_PRECONDITION", False),
    # The organization's model and data are built for another label count or input shape than the run's (which
    # the first organization to declare them fixed): joining again with the same data cannot succeed.
    "data_mismatch": Reason("FAILED_PRECONDITION", False),
    "not_declared": Reason("FAILED_PRECONDITION", False),
    "payload_kind_not_allowed": Reason("PERMISSION_DENIED", False),
    "unknown_organization": Reason("PERMISSION_DENIED", False),
    "identity_mismatch": Reason("PERMISSION_DENIED", False),
    "unauthenticated": Reason("UNAUTHENTICATED", False),
    # A client certificate that names its organization more than once (several CNs, several organization
    # URIs), names two different organizations (CN and URI disagree), or names none.
    "ambiguous_identity": Reason("UNAUTHENTICATED", False),
    "conflicting_identity": Reason("UNAUTHENTICATED", False),
    "no_identity": Reason("UNAUTHENTICATED", False),
    "oversized": Reason("RESOURCE_EXHAUSTED", False),
    "rate_limited": Reason("RESOURCE_EXHAUSTED", True),
    "late": Reason("FAILED_PRECONDITION", False),
    "not_joined": Reason("FAILED_PRECONDITION", False),
    "replayed": Reason("ALREADY_EXISTS", False),
    "unknown_run": Reason("NOT_FOUND", False),
    # The run has finished: joining it again cannot train (a reinstall onto a finished run's state).
    "run_finished": Reason("FAILED_PRECONDITION", False),
    # The aggregator does not host this run: its stored state conflicts with its config (Status says why).
    "run_refused": Reason("FAILED_PRECONDITION", False),
    # Resource limits that clear by themselves: another push of the same organization is still in flight.
    "too_many_streams": Reason("RESOURCE_EXHAUSTED", True),
    "buffer_full": Reason("RESOURCE_EXHAUSTED", True),
    # Every reassembly slot of the aggregator stayed taken while this push waited (admission control).
    "busy": Reason("RESOURCE_EXHAUSTED", True),
    # A stream that resumes a push the aggregator does not hold at that chunk (dropped, or another digest, size
    # or organization): the push is sent again from chunk 0.
    "not_resumable": Reason("FAILED_PRECONDITION", True),
    # A push stream that sent no chunk for server.push_idle_seconds: refused, so it frees its slot.
    "stalled": Reason("DEADLINE_EXCEEDED", True),
    # A chunked stream that ended before its last chunk: a connection cut under it (a client killed mid-push
    # reads this way to the aggregator), or a sender that stopped. The chunks received are kept for a resume.
    "incomplete": Reason("ABORTED", True),
    # The aggregator could not make the update (or the round's close) durable: nothing was acknowledged or
    # lost, and the same request may succeed once the state directory can be written again.
    "storage_unavailable": Reason("UNAVAILABLE", True),
    # Secure aggregation (hetfed.secagg): a stage message of another run, round or party than the one it answers.
    "foreign_message": Reason("FAILED_PRECONDITION", False),
    # A stage message for a stage that is not the open one (a replay, or one too late).
    "unexpected_stage": Reason("FAILED_PRECONDITION", False),
    # A stage message the protocol refuses: keys of the wrong size or reused, peers other than the graph's, a
    # share that does not open or rebuild, both shares of one peer asked for.
    "secagg_refused": Reason("INVALID_ARGUMENT", False),
    # Too few parties are left to unmask the round's sum: the round's secure aggregate is abandoned, nothing revealed.
    "secagg_abandoned": Reason("FAILED_PRECONDITION", False),
    # An unexpected failure inside the aggregator (a bug): logged with its traceback there.
    "internal": Reason("INTERNAL", True),
}
REASON_STATUS: dict[str, str] = {k: v.status for k, v in REASONS.items()}
# The ErrorInfo domain of hetfed's rejections.
ERROR_DOMAIN = "hetfed.v1"


# hetfed.secagg's refusal reasons -> the wire's (each a key of REASONS).
SECAGG_REASONS: dict[str, str] = {
    "foreign_message": "foreign_message",
    "unexpected_stage": "unexpected_stage",
    "duplicate": "replayed",
    "bad_keys": "secagg_refused",
    "neighbours_mismatch": "secagg_refused",
    "share_authentication_failed": "secagg_refused",
    "both_shares_requested": "secagg_refused",
    "inconsistent_shares": "secagg_refused",
    "malformed": "malformed",
    "out_of_range": "implausible_update",
    "sum_out_of_range": "implausible_update",
    "bad_parameters": "invalid_value",
    "below_threshold": "secagg_abandoned",
}


class WireError(Exception):
    """A message that breaks the wire contract; ``reason`` labels the rejection metric."""

    def __init__(self, reason: str, message: str) -> None:
        if reason not in REASONS:
            raise ValueError(f"unknown rejection reason {reason!r}")
        super().__init__(message)
        self.reason = reason
        self.message = message

    @property
    def status(self) -> str:
        """The gRPC status code name for this error."""
        return REASONS[self.reason].status

    @property
    def retryable(self) -> bool:
        """Whether sending the same request again may succeed."""
        return REASONS[self.reason].retryable

    def __str__(self) -> str:
        return f"{self.reason}: {self.message}"


def from_secagg(error: Exception) -> WireError:
    """The WireError for a ``hetfed.secagg.SecAggError`` (its ``reason`` mapped by SECAGG_REASONS)."""
    reason = getattr(error, "reason", "")
    return WireError(SECAGG_REASONS.get(reason, "internal"), f"secure aggregation: {error}")
