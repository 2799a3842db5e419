"""What a run admits: limits on Join requests and on the values inside updates, and declared example weights.

Pure checks: each raises ``WireError`` with the reason a client sees, or returns. The run (``conductor.Run``)
calls them before a request can change its state.
"""

from __future__ import annotations

import dataclasses
import math
import unicodedata
from dataclasses import dataclass
from typing import NoReturn

from hetfed.aggregator.algorithms.base import ServerHalf
from hetfed.aggregator.config import RunConfig
from hetfed.aggregator.run.state import DataShape, RunState
from hetfed.wire import contract
from hetfed.wire.errors import ORGANIZATION_LEFT_REASON, PRIVACY_BUDGET_SPENT_REASON, WireError, clip
from hetfed.wire.messages import JoinRequest, ParsedUpdate
from hetfed.wire.payloads import (
    EvalMetrics,
    FactorizedWeights,
    HeadWeights,
    ModelWeights,
    Received,
    SecAggMaskedInput,
    training_examples,
)
from hetfed.wire.phases import Phase
from hetfed.wire.privacy import PrivacyDeclaration

# Payloads whose example count is an aggregation weight.
WEIGHTED = (ModelWeights, HeadWeights, FactorizedWeights)


@dataclass(frozen=True)
class Limits:
    """Per-run limits on what arrives and how instructions are chunked."""

    chunk_bytes: int
    max_update_bytes: int
    max_tensor_elements: int
    # Example counts: an organization's declared training examples bound its updates' counts; this bounds
    # the declaration itself, and every count of an organization that declared none.
    max_examples: int = 1_000_000_000
    # Named figures (EvalMetrics.extra) in one report, and the length of every name a client chooses
    # (figures, declared tensors).
    max_metrics_per_report: int = 64
    max_name_chars: int = 128
    max_declared_tensors: int = 10_000
    # Dimensions of one input an organization declares at Join (its input_shape).
    max_input_dims: int = 8


def bad_name(name: str, limit: int) -> str:
    """Why a client-chosen name is refused ("" when it is acceptable)."""
    if not name:
        return "is empty"
    if len(name) > limit:
        return f"has {len(name)} characters; at most {limit}"
    if any(unicodedata.category(c)[0] == "C" for c in name):
        return "holds control characters"
    return ""


def check_metric_domains(m: EvalMetrics) -> None:
    """WireError ``implausible_metric`` for a test accuracy outside [0, 1] or a negative loss (NaN and
    infinities are refused earlier, ``non_finite``)."""
    if not 0.0 <= m.test_accuracy <= 1.0:
        raise WireError("implausible_metric", f"eval_metrics.test_accuracy is {m.test_accuracy:.6g}; an accuracy "
                                              "is in [0, 1] (the run's check_metric_domains)")
    for name in ("train_loss", "test_loss"):
        value = getattr(m, name)
        if not (math.isfinite(value) and value >= 0.0):
            raise WireError("implausible_metric", f"eval_metrics.{name} is {value:.6g}; a loss is finite and >= 0 "
                                                  "(the run's check_metric_domains)")


def check_join(cfg: RunConfig, limits: Limits, max_examples: int, request: JoinRequest) -> None:
    """A Join request's seed set, example count, label count, input shape and declared tensor names."""
    if cfg.seed_set is not None:
        got, want = request.seed_set, cfg.seed_set
        if got is None or got.id != want.id or got.sha256 != want.sha256:
            held = f"{got.id[:64]!r} (sha256 {got.sha256[:12]}…)" if got else "none"
            raise WireError("seed_set_mismatch", f"run {cfg.id!r} uses seed set {want.id!r} (sha256 "
                                                 f"{want.sha256[:12]}…); the client holds {held}")
    n = request.num_train_examples
    if not 0 <= n <= max_examples:
        raise WireError("invalid_value", f"num_train_examples must be in [0, {max_examples}] (the run's "
                                         f"max_examples, server.max_examples_per_organization), got {n}")
    if request.num_classes < 0:
        raise WireError("invalid_value", f"num_classes must be >= 0 (0: not declared), got {request.num_classes}")
    shape = request.input_shape
    if len(shape) > limits.max_input_dims or any(s <= 0 for s in shape):
        raise WireError("invalid_value", f"input_shape must be at most {limits.max_input_dims} positive sizes "
                                         f"(empty: not declared), got {clip(str(list(shape[:16])), 64)}")
    if len(request.declared) > limits.max_declared_tensors:
        raise WireError("oversized", f"{len(request.declared)} declared tensors; at most {limits.max_declared_tensors}")
    for d in request.declared:
        bad = bad_name(d.name, limits.max_name_chars)
        if bad:
            raise WireError("invalid_value", f"declared tensor name {clip(d.name, 64)!r} {bad}")


def check_join_request(cfg: RunConfig, limits: Limits, max_examples: int, state: RunState, organization: str,
                       request: JoinRequest) -> tuple[contract.Schema | None, DataShape]:
    """A Join request of a member of a running run checked (``check_join``), and what it declares: the tensor
    schema (None when it declares none or the algorithm shares none) and the label count and input shape (those
    the algorithm shares). A non-member's or a finished run's is left to ``state.join`` to refuse."""
    spec, declared = cfg.spec, None
    if organization in cfg.organizations and state.phase is not Phase.FINISHED:
        check_join(cfg, limits, max_examples, request)
        if request.declared and spec.shared_schema:
            declared = contract.schema_from_declared(request.declared, spec)
    return declared, DataShape(request.num_classes if spec.shared_label_space else 0,
                               request.input_shape if spec.shared_input_shape else ())


def check_update(cfg: RunConfig, limits: Limits, max_examples: int, organization: str, declared: int,
                 update: Received) -> None:
    """Example counts within what the organization declared (or the maximum); bounded named figures."""
    if cfg.example_weights == "declared" and not declared and any(isinstance(p, WEIGHTED) for p in update):
        raise WireError("invalid_value", f"run {cfg.id!r} weighs updates by the training examples declared at Join "
                                         f"(example_weights = 'declared'); {organization!r} declared none")
    bound = declared or max_examples
    why = (f"{organization!r} declared {declared} training examples at Join" if declared else
           f"it declared none, and the limit is {max_examples} (the run's max_examples, "
           "server.max_examples_per_organization)")
    for p in update:
        n = training_examples(p)
        if n is not None and not 0 <= n <= bound:
            raise WireError("invalid_value", f"{p.kind.value} claims {n} training examples; {why}")
        if isinstance(p, EvalMetrics):
            if not 0 <= p.num_test_examples <= max_examples:
                raise WireError("invalid_value", f"eval_metrics claims {p.num_test_examples} test examples; the "
                                                 f"limit is {max_examples}")
            if cfg.check_metric_domains:
                check_metric_domains(p)
            # A withheld figure's name is stored and shown like a reported one, so it counts against the same limits.
            named = len(p.extra) + len(p.withheld)
            if named > limits.max_metrics_per_report:
                raise WireError("oversized", f"eval_metrics carries {named} named figures; "
                                             f"at most {limits.max_metrics_per_report} (server.max_metrics_per_report)")
            for name in (*p.extra, *p.withheld):
                bad = bad_name(name, limits.max_name_chars)
                if bad:
                    raise WireError("invalid_value", f"eval_metrics figure name {clip(name, 64)!r} {bad}")


def check_privacy(cfg: RunConfig, organization: str, declared: PrivacyDeclaration | None,
                  last: PrivacyDeclaration | None) -> None:
    """An update's privacy declaration against the run (``declared``, already valid; None: the update declares
    none) and the organization's last accepted one (``last``): refused without one where the run requires it
    (``privacy_required``), refused when its ε went down (``privacy_regressed``: the client's ledger was lost), when
    its ledger ends with its process where the run refuses that (``privacy_ephemeral_ledger``), and when its ε is
    above the run's ``max_epsilon`` (``privacy_epsilon_exceeded``)."""
    if declared is None:
        if cfg.require_privacy:
            raise WireError("privacy_required", f"the update of organization {organization!r} declares no privacy; "
                                                f"run {cfg.id!r} requires differential privacy of every organization "
                                                "(require_privacy, docs/privacy.md)")
        return
    if cfg.refuse_ephemeral_ledgers and declared.ephemeral_ledger:
        raise WireError("privacy_ephemeral_ledger", f"organization {organization!r} keeps its privacy ledger only in "
                                                    f"its client process (privacy.ephemeral_ledger); run {cfg.id!r} "
                                                    "refuses such ledgers (refuse_ephemeral_ledgers): give the client "
                                                    "a state_dir")
    if cfg.max_epsilon is not None and declared.epsilon > cfg.max_epsilon:
        raise WireError("privacy_epsilon_exceeded", f"organization {organization!r} declared ε={declared.epsilon:.6g}; "
                                                    f"run {cfg.id!r} accepts at most ε={cfg.max_epsilon:g} "
                                                    "(max_epsilon)")
    if last is not None and declared.epsilon < last.epsilon:
        new, old = _epsilons(declared.epsilon, last.epsilon)
        raise WireError("privacy_regressed", f"organization {organization!r} declared ε={new} after ε={old}: its "
                                             "privacy ledger was lost; keep the client's state_dir")


def check_push(cfg: RunConfig, limits: Limits, max_examples: int, state: RunState, organization: str, round_: int,
               update: ParsedUpdate, half: ServerHalf, last: PrivacyDeclaration | None,  # type: ignore[type-arg]
               secure: bool = False) -> Received:
    """A pushed update checked against the run in ``state``, decoded: a leave notice is refused (``refuse_leave``);
    an update must keep the algorithm's payload contract (``ParsedUpdate.check``), the example counts and named
    figures (``check_update``), the privacy declaration (``check_privacy``, after ``last``, the organization's
    last accepted one) and what only the server half can check (``validate``; not under secure aggregation
    (``secure``), where the half never sees one update: each client checks its own ranges)."""
    if update.leaving:  # a leave notice carries no payload: refused before the payload contract would refuse it
        update.check_leave(cfg.id, round_, organization)
        refuse_leave(cfg, organization, update.privacy, update.leave_reason)
    received = update.check(cfg.spec, state.phase, state.schema, limits.max_tensor_elements, cfg.id, round_,
                            organization, secure=secure)
    check_update(cfg, limits, max_examples, organization, state.examples.get(organization, 0), received)
    check_privacy(cfg, organization, update.privacy, last)
    if not secure:
        half.validate(state.phase, organization, received)
    else:  # a masked input is its sender's own: refused before it is logged, as the coordinator would refuse it
        masked = received.maybe(SecAggMaskedInput)
        if masked is not None and masked.message.sender != organization:
            raise WireError("identity_mismatch", f"a masked input of {clip(masked.message.sender, 64)!r} pushed by "
                                                 f"{organization!r}")
    return received


def refuse_leave(cfg: RunConfig, organization: str, declared: PrivacyDeclaration | None,
                 reason: str = "") -> NoReturn:
    """Refuse a leave notice: ``privacy_budget_spent`` when its declaration says budget_spent (the organization's
    privacy budget would be exceeded by its next round), else ``organization_left`` with the ``reason`` it gave.
    Recorded as a refusal at its push, it is given up at once (``run_state``)."""
    if declared is None or not declared.budget_spent:
        assert reason
        raise WireError(ORGANIZATION_LEFT_REASON,
                        f"organization {organization!r} leaves run {cfg.id!r}: {reason}; the run goes on without it")
    raise WireError(PRIVACY_BUDGET_SPENT_REASON,
                    f"organization {organization!r} leaves run {cfg.id!r}: its privacy budget is spent "
                    f"(ε={declared.epsilon:.4g} at δ={declared.delta:.3g}); the run goes on without it")


def _epsilons(new: float, old: float) -> tuple[str, str]:
    """Two ε as the refusal prints them: two decimals, more where two would print them equal."""
    for places in (2, 6):
        a, b = f"{new:.{places}f}", f"{old:.{places}f}"
        if a != b:
            return a, b
    return f"{new!r}", f"{old!r}"


def weighted(cfg: RunConfig, declared: int, update: Received) -> Received:
    """The update with its aggregation weights replaced by the organization's declaration, when the run weighs
    by declarations (``example_weights = "declared"``)."""
    if cfg.example_weights != "declared":
        return update
    return Received([dataclasses.replace(p, num_examples=declared) if isinstance(p, WEIGHTED) else p
                     for p in update], repeated=update.kinds)
