"""The encoded instructions of a run's open round, built once and kept within a bound."""

from __future__ import annotations

import weakref
from collections import OrderedDict

import numpy as np

from hetfed.aggregator.algorithms.base import ServerHalf, round_seed
from hetfed.wire import messages
from hetfed.wire.messages import Encoded, Instructions, Pulled
from hetfed.wire.phases import Action, Phase
from hetfed.wire.serialize import Scattered
from hetfed.wire.specs import WireDtype

# Per-organization instruction messages a run keeps built (memory does not grow with the federation).
PER_ORGANIZATION_INSTRUCTIONS = 8


class InstructionCache:
    """(round, organization or "*") -> the encoded instructions of the open round: the broadcast message, or at
    most ``PER_ORGANIZATION_INSTRUCTIONS`` per-organization ones (least recently used first out; one evicted is
    rebuilt, identically, should its organization pull again). Call ``get`` under the run's lock."""

    def __init__(self, run_id: str, total_rounds: int, run_seed: int, wire_dtype: WireDtype | None) -> None:
        self.run_id, self.total_rounds, self.run_seed, self.wire_dtype = run_id, total_rounds, run_seed, wire_dtype
        self._cache: OrderedDict[tuple[int, str], Encoded] = OrderedDict()
        self._shared: list[weakref.ref[Encoded]] = []  # built messages that view a half's arrays
        self._wait: tuple[int, Encoded] | None = None
        self._finish: Encoded | None = None

    def __len__(self) -> int:
        return len(self._cache)

    def get(self, half: ServerHalf, phase: Phase, round_: int, organization: str) -> Encoded:  # type: ignore[type-arg]
        """This organization's instructions for the open round, built once (once for all when broadcast)."""
        key = (round_, "*" if half.broadcast else organization)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        for old in [k for k in self._cache if k[0] != round_]:
            del self._cache[old]
        payloads = half.payloads_for(phase, round_, organization)
        shares = getattr(half, "shares_payloads", False)  # a half that is no ServerHalf shares nothing
        encoded = self._cache[key] = messages.encode_instructions(Instructions(
            run_id=self.run_id, round=round_, action=Action.of(phase), total_rounds=self.total_rounds,
            round_seed=round_seed(self.run_seed, round_), organization="" if half.broadcast else organization,
            payloads=payloads,
        ), self.wire_dtype, scattered=shares)
        if shares:
            self._shared.append(weakref.ref(encoded))
        while len(self._cache) > PER_ORGANIZATION_INSTRUCTIONS:  # per-organization messages only ever exceed it
            self._cache.popitem(last=False)
        return encoded

    def drop(self) -> None:
        """Forget the built instructions (a round is closing: its broadcast is not sent again). A pull that is
        streaming one keeps it until it is sent: the arrays such a message views are made read-only, so the
        close does not write into them (it writes new arrays instead)."""
        self._cache.clear()
        for ref in self._shared:
            encoded = ref()  # alive: a pull holds it
            if encoded is not None and isinstance(encoded.data, Scattered):
                for a in encoded.data.arrays:
                    _freeze(a)
        self._shared = []

    def wait(self, round_: int) -> Pulled:
        """The WAIT instructions of ``round_`` (lock-free: the event loop answers an expired long-poll)."""
        cached = self._wait
        if cached is None or cached[0] != round_:
            cached = self._wait = (round_, messages.encode_instructions(
                Instructions(self.run_id, round_, Action.WAIT, self.total_rounds)))
        return Pulled(cached[1], cached[0], waiting=True)

    def finish(self, round_: int) -> Pulled:
        """The FINISH instructions of a finished run."""
        if self._finish is None:
            self._finish = messages.encode_instructions(Instructions(self.run_id, round_, Action.FINISH,
                                                                     self.total_rounds))
        return Pulled(self._finish, round_)


def _freeze(a: object) -> None:
    """Make an array and every array it views read-only."""
    while isinstance(a, np.ndarray):
        a.flags.writeable = False
        a = a.base
