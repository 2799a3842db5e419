"""An organization's side of one round's secure aggregation: the SecAgg+ client session of ``hetfed.secagg``
behind hetfed's payloads.

The aggregator's setup (``SecAggSetup``) fixes the encoding: one bounded field per array of the summed form of
the spec's summed kinds (``hetfed.wire.summation``). ``mask`` turns the round's trained payloads into that form,
checks every value against its declared bound before anything is masked (strict: a value beyond its bound is
refused here, ``implausible_update``, and nothing leaves the organization), encodes, and masks.

Distributed differential privacy: ``mask`` takes ``distributed``, a summed kind's plan (``hetfed.wire.distributed``)
with the round's rotation seed and a secret generator: that kind's weighted form is replaced by its distributed
Skellam encoding, this organization's share of the noise included, before the encoding and the masks.

A further seam: ``mask`` takes ``noise``, a function of the encoding that returns
integers (a vector of the ring's dtype, one per element) to add to the encoded input. Masking is addition mod
2^b, so the noise is added to the masked vector, which is the same ring element as noising before masking.

``SecureExchange`` runs these stages over the SecureStage RPC (the masked input rides on the push); the round
loop (``hetfed.client.rounds``) calls it in a secure run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import ParamSpec, TypeVar

import numpy as np

from hetfed import secagg
from hetfed.secagg.keys import Entropy, system_entropy
from hetfed.secagg.ring import reduce
from hetfed.wire.distributed import DistributedSum
from hetfed.wire.errors import WireError, from_secagg
from hetfed.wire.payloads import (
    Payload,
    PayloadKind,
    SecAggKeyAdvert,
    SecAggMaskedInput,
    SecAggPeerKeys,
    SecAggPeerShares,
    SecAggSetup,
    SecAggSharedKeys,
    SecAggUnmask,
)
from hetfed.wire.rpc import AggregatorClient, RemoteError
from hetfed.wire.summation import WEIGHT, fields

Noise = Callable[[secagg.Encoding], np.ndarray]
# The aggregator's refusals after which an organization sits the round out (its update not aggregated) and goes
# on to the next round: the round closed (``late``), or it is at another stage than this organization, as after
# a restart that abandoned the round's aggregate (``unexpected_stage``).
SIT_OUT = ("late", "unexpected_stage")
# Distributed DP's plan for one summed kind, the round's rotation seed and the secret generator of the rounding
# and the Skellam share (``hetfed.wire.distributed``).
Distributed = tuple[DistributedSum, int, np.random.Generator]
P = ParamSpec("P")
R = TypeVar("R")


def summed_fields(payloads: Iterable[Payload], kinds: frozenset[PayloadKind], unit: bool) -> dict[str, np.ndarray]:
    """The weighted form of the payloads of ``kinds`` (one of each), as the encoding's named arrays."""
    out: dict[str, np.ndarray] = {}
    seen = set()
    for p in payloads:
        if p.kind in kinds:
            seen.add(p.kind)
            out.update(fields(p, unit))
    if seen != kinds:
        raise WireError("missing_payload", f"secure aggregation sums {sorted(k.value for k in kinds - seen)} too")
    return out


def check_ranges(values: dict[str, np.ndarray], encoding: secagg.Encoding) -> None:
    """Refuse (``implausible_update``) a value x whose weighted form w·x lies beyond w times its declared bound:
    the bound of x is its field's bound over its weight field's (``hetfed.aggregator.run.secure.encoding_fields``).
    The encoding's strict mode then refuses a weight beyond its own bound."""
    bounds = {f.name: f.bound for f in encoding.fields}
    for name, wx in values.items():
        kind, sep, _ = name.partition("/")
        if not sep:
            continue
        weight = np.asarray(values[kind + WEIGHT], np.float64)
        limit = bounds[name] / bounds[kind + WEIGHT]
        w = weight.reshape(weight.shape + (1,) * (wx.ndim - weight.ndim))
        beyond = np.abs(wx) > w * limit * (1 + 1e-12)
        if beyond.any():
            raise WireError("implausible_update", f"{name} holds a value beyond its declared bound {limit:g}")


class SecureClient:
    """One organization in one round (module docstring); each stage runs once, in order."""

    def __init__(self, setup: SecAggSetup, organization: str, entropy: Entropy = system_entropy) -> None:
        self.setup = setup
        try:
            self.session = secagg.ClientSession(setup.config, organization, entropy)
        except secagg.SecAggError as exc:
            raise from_secagg(exc) from None

    def advertise(self) -> SecAggKeyAdvert:
        """Stage 1: this round's public keys."""
        return SecAggKeyAdvert(self._run(self.session.advertise))

    def share(self, peer_keys: SecAggPeerKeys) -> SecAggSharedKeys:
        """Stage 2: sealed shares for the neighbours that advertised."""
        return SecAggSharedKeys(self._run(self.session.share_keys, peer_keys.message))

    def mask(self, peer_shares: SecAggPeerShares, payloads: Iterable[Payload], kinds: frozenset[PayloadKind],
             rng: np.random.Generator, noise: Noise | None = None,
             distributed: Distributed | None = None) -> SecAggMaskedInput:
        """Stage 3: the summed payloads (one kind through distributed DP, when ``distributed`` is given) checked
        against their bounds (strict), encoded (``rng`` draws the stochastic rounding), noised (``noise``, if
        given) and masked."""
        values = summed_fields(payloads, kinds, self.setup.unit_weights)
        if distributed is not None:
            plan, rotation, secret = distributed
            values = plan.encode(values, rotation, secret)
        check_ranges(values, self.setup.config.encoding)
        masked = self._run(self.session.mask, peer_shares.message, values, rng, True)
        if noise is not None:
            enc = self.setup.config.encoding
            extra = np.asarray(noise(enc))
            if extra.dtype != enc.dtype or extra.shape != (enc.length,):
                raise ValueError(f"noise must be {enc.length} elements of {np.dtype(enc.dtype)}")
            masked = secagg.MaskedInput(masked.run_id, masked.round, masked.sender,
                                        reduce(masked.vector + extra, enc.ring_bits))
        return SecAggMaskedInput(masked)

    def unmask(self, request: SecAggUnmask) -> SecAggUnmask:
        """Stage 4: the shares asked for, never both of one peer."""
        if not isinstance(request.message, secagg.UnmaskRequest):
            raise WireError("payload_kind_not_allowed", "a client answers an unmask request, not a reply")
        return SecAggUnmask(self._run(self.session.unmask, request.message))

    @staticmethod
    def _run(step: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return step(*args, **kwargs)
        except secagg.SecAggError as exc:
            raise from_secagg(exc) from None


class SecureExchange:
    """One organization's secure aggregation of one round over the SecureStage RPC (``client``: its
    ``AggregatorClient``): ``masked_upload`` before the push (setup, advertise, share, mask), ``unmask`` after
    it. Each wait is a long-poll of ``wait_seconds``, asked again until the stage closes. An organization left out
    of the round (it came after stage 1 closed, or the round's aggregate ended before it masked) waits for the
    round to end and sends nothing: ``masked_upload`` then gives None. So does one refused ``unexpected_stage``
    (the aggregator at another stage, as after a restart that abandoned the round's aggregate)."""

    def __init__(self, client: AggregatorClient, organization: str, round_: int, wait_seconds: float,
                 entropy: Entropy = system_entropy) -> None:
        self.client, self.round, self.wait = client, round_, wait_seconds
        self.refused = ""  # why this organization refused its own update before masking ("" while it did not)
        setup = self._next(None)  # past stage 1 it waits here for the round to end
        self.secure = SecureClient(setup, organization, entropy) if isinstance(setup, SecAggSetup) else None

    def _next(self, payload: Payload | None) -> Payload | None:
        """Send ``payload`` (or nothing) and wait for this organization's next stage message; None when the
        round's secure aggregate ended without one (done or abandoned, or the round closed: ``late``), or when
        the aggregator is at another stage than this organization (``unexpected_stage``: it sits the round out)."""
        try:
            reply = self.client.secure_stage(self.round, payload, self.wait)
            while reply.payload is None and not reply.abandoned and reply.stage not in ("done", "abandoned"):
                reply = self.client.secure_stage(self.round, None, self.wait)
        except RemoteError as err:
            if err.reason not in SIT_OUT:
                raise
            return None
        return reply.payload

    def masked_upload(self, upload: Iterable[Payload], kinds: frozenset[PayloadKind], rng: np.random.Generator,
                      noise: Noise | None = None, distributed: Distributed | None = None) -> list[Payload] | None:
        """The upload to push: its summed ``kinds`` replaced by their masked input (the rest as it is); None when
        the organization is left out of the round (class docstring), once the round has ended, or when it refuses
        its own update (a value beyond its declared bound: ``refused`` says which). Nothing of a refused update
        leaves: the organization is a dropout after sharing its keys, whose masks its neighbours' shares remove."""
        upload = list(upload)
        if self.secure is None:
            return None
        keys = self._next(self.secure.advertise())  # None: stage 1 closed before its advert arrived
        shares = self._next(self.secure.share(keys)) if isinstance(keys, SecAggPeerKeys) else None
        if not isinstance(shares, SecAggPeerShares):
            self._next(None)  # left out: wait for the round to end
            return None
        try:
            masked = self.secure.mask(shares, upload, kinds, rng, noise, distributed)
        except WireError as err:
            if err.reason != "implausible_update":
                raise
            self.refused = str(err)
            return None
        return [masked, *(p for p in upload if p.kind not in kinds)]

    def unmask(self) -> bool:
        """Answer the round's unmask request; False when the round ended without asking this organization."""
        request = self._next(None)
        if self.secure is None or not isinstance(request, SecAggUnmask):
            return False
        try:
            self.client.secure_stage(self.round, self.secure.unmask(request), 0)
        except RemoteError as err:  # the round closed, or its aggregate was abandoned, meanwhile
            if err.reason not in SIT_OUT:
                raise
            return False
        return True
