"""The server's side of one round of SecAgg+, as a state machine: it collects adverts, routes the sealed
shares, collects masked inputs, asks the survivors for shares and unmasks the sum.

Before masking, a client that is missing (or left with fewer than t live neighbours) is excluded: its
neighbours neither share with it nor mask with it. After masking nobody can be excluded: if a survivor's self
mask or a dropped client's mask key cannot be rebuilt from t shares, the round is abandoned (``AbandonedError``)
before any share is asked for, or, when too few answer the unmask request, with the shares received unused.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NoReturn

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from hetfed.secagg import keys, prg, shamir
from hetfed.secagg.errors import AbandonedError, SecAggError
from hetfed.secagg.messages import (
    Aggregate,
    KeyAdvert,
    MaskedInput,
    PeerKeys,
    PeerShares,
    RoundConfig,
    SharedKeys,
    UnmaskReply,
    UnmaskRequest,
)
from hetfed.secagg.ring import reduce


def prune(present: Iterable[str], graph: dict[str, frozenset[str]], threshold: int) -> frozenset[str]:
    """``present`` less every member left with fewer than ``threshold`` neighbours in it, repeatedly."""
    kept = set(present)
    while weak := {u for u in kept if len(graph[u] & kept) < threshold}:
        kept -= weak
    return frozenset(kept)


class ServerSession:
    """The server in one round. ``receive_*`` take one client's message of the open stage; ``close_*`` end a
    stage and give each remaining client its next message; ``finish`` gives the sum."""

    def __init__(self, config: RoundConfig) -> None:
        self.config = config
        self._stage = "advertise"
        self._adverts: dict[str, KeyAdvert] = {}
        self._peers: dict[str, frozenset[str]] = {}  # client -> the neighbours it shares with
        self._shared: dict[str, SharedKeys] = {}
        self._masking: dict[str, frozenset[str]] = {}  # client -> the neighbours it masks with
        self._inputs: set[str] = set()  # the clients whose masked input arrived
        self._total = np.zeros(config.encoding.length, config.encoding.dtype)  # their sum, mod 2^b
        self._survivors: frozenset[str] = frozenset()
        self._dropped: frozenset[str] = frozenset()
        self._replies: dict[str, UnmaskReply] = {}
        self.excluded: dict[str, str] = {}  # client -> the stage it was left out at
        self.revealed: dict[str, set[str]] = {}  # client -> which of its secrets' shares arrived ("seed", "key")

    @property
    def stage(self) -> str:
        return self._stage

    def _expect(self, stage: str, run_id: str, round_no: int, sender: str, seen: Iterable[str],
                allowed: Iterable[str]) -> None:
        self.config.check(run_id, round_no, sender, sender, f"a {stage} message")
        if self._stage != stage:
            raise SecAggError("unexpected_stage", f"a {stage} message from {sender!r} while at {self._stage}")
        if sender not in allowed:
            raise SecAggError("foreign_message", f"{sender!r} is not in the round at {stage}")
        if sender in seen:
            raise SecAggError("duplicate", f"a second {stage} message from {sender!r}")

    def _at(self, stage: str) -> None:
        if self._stage != stage:
            raise SecAggError("unexpected_stage", f"closing {stage} while at {self._stage}")

    def _abandon(self, stage: str, detail: str) -> NoReturn:
        self._stage = "abandoned"
        raise AbandonedError(stage, detail)

    def _keep(self, present: Iterable[str], stage: str) -> frozenset[str]:
        kept = prune(present, self.config.graph, self.config.threshold)
        for name in sorted(set(self.config.roster) - kept):
            self.excluded.setdefault(name, stage)
        if not kept:
            self._abandon(stage, f"no client has {self.config.threshold} live neighbours")
        return kept

    def receive_advert(self, msg: KeyAdvert) -> None:
        """Stage 1: one client's public keys."""
        self._expect("advertise", msg.run_id, msg.round, msg.sender, self._adverts, self.config.roster)
        sizes = {len(msg.share_public), len(msg.mask_public)}
        if sizes != {keys.KEY_BYTES} or msg.share_public == msg.mask_public:
            raise SecAggError("bad_keys", f"{msg.sender!r} advertised keys of the wrong size or one key twice")
        self._adverts[msg.sender] = msg

    def close_advertising(self) -> dict[str, PeerKeys]:
        """End stage 1: each kept client gets the adverts of its neighbours that advertised."""
        self._at("advertise")
        kept = self._keep(self._adverts, "advertise")
        self._peers = {u: self.config.graph[u] & kept for u in kept}
        self._stage = "share_keys"
        return {u: PeerKeys(self.config.run_id, self.config.round, u,
                            tuple(self._adverts[v] for v in sorted(self._peers[u]))) for u in sorted(kept)}

    def receive_shared_keys(self, msg: SharedKeys) -> None:
        """Stage 2: one client's sealed shares, exactly one for each neighbour it was sent."""
        self._expect("share_keys", msg.run_id, msg.round, msg.sender, self._shared, self._peers)
        receivers = [s.receiver for s in msg.shares]
        if any(s.sender != msg.sender for s in msg.shares) or sorted(receivers) != sorted(self._peers[msg.sender]):
            raise SecAggError("neighbours_mismatch", f"{msg.sender!r} sealed shares for {sorted(receivers)}")
        self._shared[msg.sender] = msg

    def close_sharing(self) -> dict[str, PeerShares]:
        """End stage 2: each kept client gets the shares sealed for it by its kept neighbours."""
        self._at("share_keys")
        kept = self._keep(self._shared, "share_keys")
        self._masking = {u: self.config.graph[u] & kept for u in kept}
        routed: dict[str, list] = {u: [] for u in kept}
        for sender in sorted(kept):
            for sealed in self._shared[sender].shares:
                if sealed.receiver in kept:
                    routed[sealed.receiver].append(sealed)
        self._stage = "mask"
        return {u: PeerShares(self.config.run_id, self.config.round, u, tuple(routed[u])) for u in sorted(kept)}

    def receive_masked(self, msg: MaskedInput) -> None:
        """Stage 3: one client's masked input, added to the running sum at once (the server keeps one vector,
        not one per client); refused once the survivors are decided."""
        self._expect("mask", msg.run_id, msg.round, msg.sender, self._inputs, self._masking)
        enc = self.config.encoding
        v = msg.vector
        if not isinstance(v, np.ndarray) or v.dtype != enc.dtype or v.shape != (enc.length,):
            raise SecAggError("malformed", f"{msg.sender!r}'s masked input is not {enc.length} ring elements")
        if enc.ring_bits not in (32, 64) and v.size and int(v.max()) >> enc.ring_bits:
            raise SecAggError("malformed", f"{msg.sender!r}'s masked input holds a value beyond 2^{enc.ring_bits}")
        self._total += v
        self._inputs.add(msg.sender)

    def close_masking(self) -> dict[str, UnmaskRequest]:
        """End stage 3: decide the survivors and ask each for shares, or abandon if some mask could not be
        removed (before asking for anything)."""
        self._at("mask")
        survivors = frozenset(self._inputs)
        dropped = frozenset(self._masking) - survivors
        t = self.config.threshold
        if not survivors:
            self._abandon("mask", "no masked input arrived")
        for name in sorted(self._masking):
            live = self._masking[name] & survivors
            if (name in survivors or live) and len(live) < t:
                what = "self mask" if name in survivors else "mask key"
                self._abandon("mask", f"{name!r}'s {what} needs {t} shares, {len(live)} neighbours survived")
        for name in dropped:
            self.excluded.setdefault(name, "mask")
        self._survivors, self._dropped = survivors, dropped
        self._stage = "unmask"
        return {v: UnmaskRequest(self.config.run_id, self.config.round, v,
                                 tuple(sorted(self._masking[v] & survivors)),
                                 tuple(sorted(self._masking[v] & dropped))) for v in sorted(survivors)}

    def receive_unmask(self, msg: UnmaskReply) -> None:
        """Stage 4: one survivor's shares, exactly those it was asked for."""
        self._expect("unmask", msg.run_id, msg.round, msg.sender, self._replies, self._survivors)
        near = self._masking[msg.sender]
        for kind, got, want in (("seed", msg.seed_shares, near & self._survivors),
                                ("key", msg.key_shares, near & self._dropped)):
            if sorted(s.owner for s in got) != sorted(want):
                raise SecAggError("neighbours_mismatch", f"{msg.sender!r} sent {kind} shares of other clients")
            for s in got:
                if shamir.Share.from_bytes(s.share).index != self.config.index(msg.sender):
                    raise SecAggError("malformed", f"{msg.sender!r} sent a share of another evaluation point")
        self._replies[msg.sender] = msg
        for kind, got in (("seed", msg.seed_shares), ("key", msg.key_shares)):
            for s in got:
                self.revealed.setdefault(s.owner, set()).add(kind)

    def _shares(self, owner: str, kind: str) -> list[shamir.Share]:
        found = []
        for reply in self._replies.values():
            for s in reply.seed_shares if kind == "seed" else reply.key_shares:
                if s.owner == owner:
                    found.append(shamir.Share.from_bytes(s.share))
        return sorted(found, key=lambda s: s.index)

    def finish(self) -> Aggregate:
        """End stage 4: rebuild the survivors' self-mask seeds and the dropped clients' mask keys, remove every
        mask and decode the sum; abandoned if some secret has fewer than t shares."""
        self._at("unmask")
        t = self.config.threshold
        needed = [(u, "seed") for u in sorted(self._survivors)]
        needed += [(d, "key") for d in sorted(self._dropped) if self._masking[d] & self._survivors]
        shares = {(name, kind): self._shares(name, kind) for name, kind in needed}
        for (name, kind), got in shares.items():
            if len(got) < t:
                self._abandon("unmask", f"{len(got)} of {name!r}'s {kind} shares arrived, {t} needed")
        try:
            total = self._unmasked(shares)
            values = self.config.encoding.decode_sum(total, len(self._survivors))
        except SecAggError:
            self._stage = "abandoned"
            raise
        self._stage = "done"
        return Aggregate(tuple(sorted(self._survivors)), tuple(sorted(self._dropped)), total, values)

    def _unmasked(self, shares: dict[tuple[str, str], list[shamir.Share]]) -> np.ndarray:
        enc, t, cfg = self.config.encoding, self.config.threshold, self.config
        total = self._total.copy()
        for name in sorted(self._survivors):
            total -= prg.expand(shamir.combine(shares[name, "seed"], t, prg.SEED_BYTES), enc.length, enc.ring_bits)
        for (name, kind), got in sorted(shares.items()):
            if kind != "key":
                continue
            private = shamir.combine(got, t, keys.KEY_BYTES)
            if X25519PrivateKey.from_private_bytes(private).public_key().public_bytes_raw() != \
                    self._adverts[name].mask_public:
                raise SecAggError("inconsistent_shares", f"{name!r}'s rebuilt mask key is not its advertised one")
            for peer in sorted(self._masking[name] & self._survivors):
                seed = keys.agree(private, self._adverts[peer].mask_public, keys.MASK_PURPOSE, cfg.run_id,
                                  cfg.round, name, peer)
                mask = prg.expand(seed, enc.length, enc.ring_bits)
                if prg.pairwise_sign(peer, name) > 0:
                    total -= mask
                else:
                    total += mask
        return reduce(total, enc.ring_bits)
