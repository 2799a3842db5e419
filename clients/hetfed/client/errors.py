"""Errors shared by the client's rooms, in a module that imports none of them: the training loop and the privacy
mechanisms (the training loop refuses a private objective it cannot bound, and the privacy package builds on the
training loop), the runtime and its round loop (a refusal no retry can fix, a spent privacy budget)."""

from __future__ import annotations


class PrivacyError(ValueError):
    """The mechanism cannot serve this model, objective or algorithm (said in one line)."""


class ClientError(RuntimeError):
    """The aggregator refused this client for a reason retrying cannot fix, or stayed unreachable.

    ``permanent``: no retry of the same process can succeed (a refusal by reason, a state directory that
    belongs to another run); the CLI exits 2 so a Job's failure policy fails at once instead of retrying."""

    def __init__(self, message: str, permanent: bool = False) -> None:
        super().__init__(message)
        self.permanent = permanent


class PrivacyBudgetSpent(ClientError):  # noqa: N818 (an outcome, not a fault)
    """The organization's privacy budget would be exceeded by its next round: it sends nothing more and leaves the
    run (exit status 3; the round goes on under the quorum rules)."""

    exit_status = 3

    def __init__(self, message: str) -> None:
        super().__init__(message, permanent=True)
