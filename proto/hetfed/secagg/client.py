"""A client's side of one round of SecAgg+, as a state machine: advertise -> share keys -> mask -> unmask."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from hetfed.secagg import keys, prg, shamir
from hetfed.secagg.errors import AbandonedError, SecAggError
from hetfed.secagg.messages import (
    EncryptedShare,
    KeyAdvert,
    MaskedInput,
    PeerKeys,
    PeerShares,
    RevealedShare,
    RoundConfig,
    SharedKeys,
    UnmaskReply,
    UnmaskRequest,
)
from hetfed.secagg.ring import reduce

STAGES = ("advertise", "share_keys", "mask", "unmask", "done")


def share_binding(config: RoundConfig, sender: str, receiver: str) -> bytes:
    """The associated data of a sealed share: run, round, sender and receiver, in that order."""
    return keys.binding(b"share", config.run_id, config.round, sender, receiver)


class ClientSession:
    """One client in one round. Each stage is a method taking the server's message and returning the reply;
    each may run once, in order. It never reveals both shares it holds of one peer."""

    def __init__(self, config: RoundConfig, me: str, entropy: keys.Entropy = keys.system_entropy) -> None:
        if me not in config.roster:
            raise SecAggError("foreign_message", f"{me!r} is not in the round's roster")
        self.config = config
        self.me = me
        self._entropy = entropy
        self._stage = "advertise"
        self._share_keys = keys.KeyPair.generate(entropy)
        self._mask_keys = keys.KeyPair.generate(entropy)
        self._peers: dict[str, KeyAdvert] = {}
        self._seed = b""
        self._held: dict[str, tuple[bytes, bytes]] = {}  # peer -> (its seed share, its key share), both held here

    @property
    def stage(self) -> str:
        return self._stage

    def _enter(self, stage: str) -> None:
        if self._stage != stage:
            raise SecAggError("unexpected_stage", f"{self.me}: a {stage} message while at {self._stage}")
        self._stage = STAGES[STAGES.index(stage) + 1]

    def advertise(self) -> KeyAdvert:
        """Stage 1: this round's two public keys."""
        self._enter("advertise")
        return KeyAdvert(self.config.run_id, self.config.round, self.me, self._share_keys.public,
                         self._mask_keys.public)

    def share_keys(self, msg: PeerKeys) -> SharedKeys:
        """Stage 2: Shamir shares of a fresh self-mask seed and of the mask key, one sealed for each neighbour
        that advertised. Refused if a peer is not a neighbour, keys repeat, or fewer than t neighbours are left."""
        self.config.check(msg.run_id, msg.round, msg.receiver, self.me, "peer keys")
        self._enter("share_keys")
        names = [p.sender for p in msg.peers]
        if len(set(names)) != len(names) or not set(names) <= self.config.graph[self.me]:
            raise SecAggError("neighbours_mismatch", f"{self.me}: peers {sorted(names)} are not its neighbours")
        public = [k for p in msg.peers for k in (p.share_public, p.mask_public)]
        public += [self._share_keys.public, self._mask_keys.public]
        if len(set(public)) != len(public) or any(len(k) != keys.KEY_BYTES for k in public):
            raise SecAggError("bad_keys", f"{self.me}: a public key repeats or has the wrong size")
        for p in msg.peers:
            self.config.check(p.run_id, p.round, p.sender, p.sender, "peer advert")
        if len(msg.peers) < self.config.threshold:
            raise AbandonedError("share_keys", (
                f"{self.me} has {len(msg.peers)} neighbours left, threshold {self.config.threshold}"))
        self._peers = {p.sender: p for p in msg.peers}
        self._seed = self._entropy(prg.SEED_BYTES)
        points = [self.config.index(name) for name in sorted(self._peers)]
        seed_shares = shamir.split(self._seed, self.config.threshold, points, self._entropy)
        key_shares = shamir.split(self._mask_keys.private, self.config.threshold, points, self._entropy)
        sealed = []
        for name, s, k in zip(sorted(self._peers), seed_shares, key_shares, strict=True):
            key = keys.agree(self._share_keys.private, self._peers[name].share_public, keys.SHARE_PURPOSE,
                             self.config.run_id, self.config.round, self.me, name)
            plaintext = keys.length_prefixed(self.me.encode(), name.encode(), s.to_bytes(), k.to_bytes())
            ciphertext = keys.seal(key, plaintext, share_binding(self.config, self.me, name), self._entropy)
            sealed.append(EncryptedShare(self.me, name, ciphertext))
        return SharedKeys(self.config.run_id, self.config.round, self.me, tuple(sealed))

    def _open(self, sealed: EncryptedShare) -> tuple[bytes, bytes]:
        """The (seed share, key share) a neighbour sealed for this client, checked against its binding."""
        if sealed.receiver != self.me or sealed.sender not in self._peers:
            raise SecAggError("foreign_message",
                              f"{self.me}: a share from {sealed.sender!r} to {sealed.receiver!r}")
        key = keys.agree(self._share_keys.private, self._peers[sealed.sender].share_public, keys.SHARE_PURPOSE,
                         self.config.run_id, self.config.round, self.me, sealed.sender)
        plain = keys.open_sealed(key, sealed.ciphertext, share_binding(self.config, sealed.sender, self.me))
        sender, receiver, seed_share, key_share = keys.split_prefixed(plain, 4)
        if (sender.decode(), receiver.decode()) != (sealed.sender, self.me):
            raise SecAggError("foreign_message", f"{self.me}: a sealed share names another pair")
        for raw in (seed_share, key_share):
            if shamir.Share.from_bytes(raw).index != self.config.index(self.me):
                raise SecAggError("malformed", f"{self.me}: a share for another evaluation point")
        return seed_share, key_share

    def mask(self, msg: PeerShares, values: Mapping[str, np.ndarray], rng: np.random.Generator | None = None,
             strict: bool = False) -> MaskedInput:
        """Stage 3: the encoded ``values`` (``rng`` draws the stochastic rounding; ``strict`` refuses values
        out of range) plus the self mask and a pairwise mask with every neighbour whose shares arrived."""
        self.config.check(msg.run_id, msg.round, msg.receiver, self.me, "peer shares")
        self._enter("mask")
        senders = [s.sender for s in msg.shares]
        if len(set(senders)) != len(senders):
            raise SecAggError("duplicate", f"{self.me}: two shares from one neighbour")
        self._held = {s.sender: self._open(s) for s in msg.shares}
        if len(self._held) < self.config.threshold:
            raise AbandonedError("mask", (
                f"{self.me} holds shares of {len(self._held)} neighbours, threshold {self.config.threshold}"))
        return MaskedInput(self.config.run_id, self.config.round, self.me,
                           self._masked(self.config.encoding.encode(values, rng, strict)))

    def _masked(self, vector: np.ndarray) -> np.ndarray:
        enc = self.config.encoding
        vector = vector + prg.expand(self._seed, enc.length, enc.ring_bits)
        for name in sorted(self._held):
            seed = keys.agree(self._mask_keys.private, self._peers[name].mask_public, keys.MASK_PURPOSE,
                              self.config.run_id, self.config.round, self.me, name)
            mask = prg.expand(seed, enc.length, enc.ring_bits)
            if prg.pairwise_sign(self.me, name) > 0:
                vector += mask
            else:
                vector -= mask
        return reduce(vector, enc.ring_bits)

    def unmask(self, msg: UnmaskRequest) -> UnmaskReply:
        """Stage 4: for each neighbour that masked with this client, its seed share if it survived or its key
        share if it dropped. Refused if a peer is listed both ways, the lists are not exactly those neighbours,
        or fewer than t of them survived."""
        self.config.check(msg.run_id, msg.round, msg.receiver, self.me, "unmask request")
        self._enter("unmask")
        survivors, dropped = set(msg.survivors), set(msg.dropped)
        if survivors & dropped:
            raise SecAggError("both_shares_requested", (
                f"{self.me}: asked both shares of {sorted(survivors & dropped)}"))
        if len(survivors) != len(msg.survivors) or len(dropped) != len(msg.dropped):
            raise SecAggError("duplicate", f"{self.me}: a peer listed twice in the unmask request")
        if survivors | dropped != set(self._held):
            raise SecAggError("neighbours_mismatch", (
                f"{self.me}: the request lists {sorted(survivors | dropped)}, "
                f"it masked with {sorted(self._held)}"))
        if len(survivors) < self.config.threshold:
            raise AbandonedError("unmask", (
                f"{self.me}: {len(survivors)} neighbours survived, threshold {self.config.threshold}"))
        return UnmaskReply(
            self.config.run_id, self.config.round, self.me,
            tuple(RevealedShare(name, self._held[name][0]) for name in sorted(survivors)),
            tuple(RevealedShare(name, self._held[name][1]) for name in sorted(dropped)))
