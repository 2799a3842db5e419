"""What the experiment side knows about an algorithm: local-run defaults, figure labels, its page.

None of it crosses the wire, so none of it is in the spec (``hetfed.wire.specs``): ``hetfed run`` and
``hetfed bench`` read it here by the spec's name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

ANY_DATASET = "*"


@dataclass(frozen=True)
class LocalDefaults:
    """What ``hetfed run`` uses for an algorithm unless the user says otherwise; ``None`` leaves it open.

    ``config`` overrides fields of the algorithm's config (the training knobs included). ``partition`` is the
    data partition the algorithm needs by default; one ``hetfed run`` shares its data settings across runs.
    """

    rounds: int | None = None
    models: tuple[str, ...] = ()
    latent_dim: int | None = None
    partition: str | None = None
    config: Mapping[str, Any] = field(default_factory=dict)

    def over(self, base: LocalDefaults) -> LocalDefaults:
        """These defaults laid over ``base``: every field set here wins."""
        return LocalDefaults(
            rounds=self.rounds if self.rounds is not None else base.rounds,
            models=self.models or base.models,
            latent_dim=self.latent_dim if self.latent_dim is not None else base.latent_dim,
            partition=self.partition if self.partition is not None else base.partition,
            config={**base.config, **self.config},
        )


@dataclass(frozen=True)
class FigureLabel:
    """How ``hetfed run`` shows one of the spec's figures (by its key)."""

    label: str
    description: str = ""


@dataclass(frozen=True)
class Experiment:
    """One algorithm's experiment settings: defaults by dataset, labels of its figures, its documentation page."""

    # ``hetfed run`` defaults by dataset name (``ANY_DATASET`` for every dataset; a dataset's entry wins).
    defaults: Mapping[str, LocalDefaults] = field(default_factory=dict)
    labels: Mapping[str, FigureLabel] = field(default_factory=dict)
    # The algorithm's page under docs/ ("": algorithms/<name>.md).
    docs: str = ""
    # Non-empty: reports compare every run's bytes per round with this algorithm's runs (the whole model each
    # way), under this label ("ratio to LABEL"). Read by the algorithm's own name: its presets are not the reference.
    bytes_reference: str = ""

    def defaults_for(self, dataset: str) -> LocalDefaults:
        """The local-run defaults on ``dataset`` (its own entry over the every-dataset entry)."""
        base = self.defaults.get(ANY_DATASET, LocalDefaults())
        own = self.defaults.get(dataset)
        return own.over(base) if own is not None else base

    def label(self, key: str) -> str:
        """The label of figure ``key`` (the key itself when none is given)."""
        entry = self.labels.get(key)
        return entry.label if entry is not None else key
