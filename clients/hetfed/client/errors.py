"""Errors shared by the training loop and the privacy mechanisms, in a module that imports neither (the training
loop refuses a private objective it cannot bound, and the privacy package builds on the training loop)."""

from __future__ import annotations


class PrivacyError(ValueError):
    """The mechanism cannot serve this model, objective or algorithm (said in one line)."""
