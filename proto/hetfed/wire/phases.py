"""The phases of a run and the actions an organization is told to take (shared by aggregator and clients)."""

from __future__ import annotations

import enum


class Phase(enum.Enum):
    """Where a run stands: setup (round 0, only for algorithms that upload something once), train
    (rounds 1..R), evaluate (round R + 1: report metrics of the final state), finished."""

    SETUP = "setup"
    TRAIN = "train"
    EVALUATE = "evaluate"
    FINISHED = "finished"


class Action(enum.Enum):
    """What an organization's instructions tell it to do next."""

    WAIT = "wait"
    SETUP = "setup"
    TRAIN = "train"
    EVALUATE = "evaluate"
    FINISH = "finish"

    @classmethod
    def of(cls, phase: Phase) -> Action:
        """The action a client takes in ``phase``."""
        return _ACTION_OF[phase]


_ACTION_OF = {Phase.SETUP: Action.SETUP, Phase.TRAIN: Action.TRAIN, Phase.EVALUATE: Action.EVALUATE,
              Phase.FINISHED: Action.FINISH}
