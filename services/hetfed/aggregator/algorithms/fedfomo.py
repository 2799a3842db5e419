"""FedFomo's server half (numpy only): the affinity matrix P and the relay of peers' models.

The aggregator stands where FedFomo's server stands (Zhang et al. 2021; github:NVlabs/FedFomo, server.py and
federation.py): it keeps every organization's model of the last closed training round, and in round r sends
organization i the models of up to ``peers_per_round`` peers chosen ε-greedily by row i of P
(``hetfed.wire.specs.fedfomo.choose_peers``), with a PeerWeights naming them in the same order (and i's
affinity to each). It averages nothing: the models it relays are the arrays it received.

P starts at ``self_affinity``·I (client.py:279-288). When i reports w over the models it weighed (its own first,
then the peers in the order sent), row i gains w / |Σ w| (federation.py:396-418: the signed weights, each
divided by the absolute sum; a sum under 1e-9 in magnitude gets 1e-9 added). Rows follow the run's
organizations in sorted order, so the matrix does not depend on arrival order.
"""

from __future__ import annotations

import zlib

import numpy as np

from hetfed.aggregator.algorithms.base import RunInfo, ServerHalf
from hetfed.wire.errors import WireError
from hetfed.wire.payloads import ModelWeights, Payload, PeerWeights, Received
from hetfed.wire.phases import Phase
from hetfed.wire.specs import fedfomo
from hetfed.wire.specs.fedfomo import FedFomoConfig, choose_peers

# The reference code's guard on the normalising sum (federation.py:401-403).
TINY_SUM = 1e-9


def affinity_step(weights: np.ndarray) -> np.ndarray:
    """What one report of weights w adds to its sender's row of P: w / |Σ w|, the sum nudged by 1e-9 when its
    magnitude is under 1e-9 (float64)."""
    w = np.asarray(weights, dtype=np.float64)
    norm = abs(float(w.sum()))
    if norm < TINY_SUM:
        norm += TINY_SUM
    return w / norm


@fedfomo.SPEC.server_half
class FedFomoServer(ServerHalf[FedFomoConfig]):
    """FedFomo's server: P, each organization's last model, and each organization's peers of the open round."""

    broadcast = False

    def __init__(self, config: FedFomoConfig, run: RunInfo) -> None:
        super().__init__(config, run)
        self.orgs = tuple(sorted(run.organizations))
        self.index = {o: i for i, o in enumerate(self.orgs)}
        self.affinity = config.self_affinity * np.eye(len(self.orgs), dtype=np.float64)
        self._relay: dict[str, ModelWeights] = {}  # the models of the last closed training round
        self._incoming: dict[str, ModelWeights] = {}
        self._reports: dict[str, PeerWeights] = {}
        self.open_round = 1
        self._peers: dict[str, list[str]] = {}  # the open round's choice, by receiver

    def peers(self, organization: str) -> list[str]:
        """The peers whose models ``organization`` receives in the open round (computed once a round from P,
        the models held and a generator seeded by the run, the round and the organization)."""
        chosen = self._peers.get(organization)
        if chosen is None:
            i = self.index.get(organization)
            if i is None:
                return []
            available = [self.index[o] for o in self.orgs if o != organization and o in self._relay]
            rng = np.random.default_rng([self.run.seed, self.open_round, zlib.crc32(organization.encode())])
            picks = choose_peers(self.affinity[i], available, self.config.peers_per_round,
                                 self.config.exploration(self.open_round), rng)
            chosen = self._peers[organization] = [self.orgs[j] for j in picks]
        return chosen

    def payloads_for(self, phase: Phase, round_: int, organization: str) -> list[Payload]:
        """The chosen peers' models, after a PeerWeights naming them in order with the receiver's affinity."""
        if round_ != self.open_round:
            self.open_round, self._peers = round_, {}
        if phase not in (Phase.TRAIN, Phase.EVALUATE):
            return []
        peers = self.peers(organization)
        if not peers:
            return []
        row = self.affinity[self.index[organization]]
        names = PeerWeights(tuple(peers), np.array([row[self.index[p]] for p in peers], dtype=np.float32))
        return [names, *(self._relay[p] for p in peers)]

    def validate(self, phase: Phase, organization: str, update: Received) -> None:
        """A training upload's PeerWeights names the organization itself and then the peers it was sent, in
        that order, with one finite weight each; an organization sent peers must report them."""
        if phase is not Phase.TRAIN:
            return
        report = update.maybe(PeerWeights)
        sent = self.peers(organization)
        if report is None:
            if sent:
                raise WireError("missing_payload", f"{organization!r} was sent {len(sent)} peer models this round "
                                                   "and must report its peer_weights")
            return
        want = (organization, *sent)
        if report.organizations != want:
            got = [o[:64] for o in report.organizations[:8]]
            raise WireError("invalid_value", f"peer_weights from {organization!r} name {got}; this round it weighs "
                                             f"{list(want)} (itself, then its peers in the order sent)")
        w = report.weights
        if w.dtype.kind != "f" or w.shape != (len(want),):
            raise WireError("shape_mismatch", f"peer_weights from {organization!r}: weights must be a float vector "
                                              f"[{len(want)}], got {w.dtype}{list(w.shape)}")

    def accumulate(self, phase: Phase, organization: str, update: Received) -> None:
        """Keep the organization's trained model and its report until the round closes."""
        if phase is not Phase.TRAIN:
            return
        mw = update.get(ModelWeights)
        self._incoming[organization] = ModelWeights({k: np.array(v) for k, v in mw.tensors.items()},
                                                    mw.num_examples)
        report = update.maybe(PeerWeights)
        if report is not None:
            self._reports[organization] = PeerWeights(report.organizations, np.array(report.weights))

    def close_round(self, phase: Phase, round_: int) -> None:
        """Each report adds to its sender's row of P (rows in sorted order); the round's models become what the
        next round relays."""
        if phase is Phase.TRAIN:
            for org in sorted(self._reports):
                report = self._reports[org]
                row = self.index[org]
                for name, step in zip(report.organizations, affinity_step(report.weights), strict=True):
                    self.affinity[row, self.index[name]] += step
            self._relay = dict(sorted(self._incoming.items()))
        self._incoming, self._reports, self._peers = {}, {}, {}
        self.open_round = round_ + 1

    def state(self) -> dict[str, np.ndarray]:
        """P, the open round and the models to relay, by organization."""
        out: dict[str, np.ndarray] = {"affinity": self.affinity.copy(),
                                      "open_round": np.array(self.open_round, dtype=np.int64)}
        for org, mw in self._relay.items():
            out[f"examples/{org}"] = np.array(mw.num_examples, dtype=np.int64)
            for name, a in mw.tensors.items():
                out[f"model/{org}/{name}"] = a
        return out

    def load_state(self, arrays: dict[str, np.ndarray]) -> None:
        """Restore from ``state()``."""
        if not arrays:
            return
        self.affinity = np.asarray(arrays["affinity"], dtype=np.float64).copy()
        self.open_round = int(arrays["open_round"])
        tensors: dict[str, dict[str, np.ndarray]] = {}
        for key, a in arrays.items():
            if key.startswith("model/"):
                _, org, name = key.split("/", 2)
                tensors.setdefault(org, {})[name] = np.array(a)
        self._relay = {org: ModelWeights(t, int(arrays[f"examples/{org}"])) for org, t in sorted(tensors.items())}
        self._incoming, self._reports, self._peers = {}, {}, {}
