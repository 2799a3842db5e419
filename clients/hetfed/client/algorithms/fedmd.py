"""FedMD's client half: digest the consensus, revisit the private data, then score the next public subset.

The model (any architecture with the run's classes) never leaves the organization. FedMD's round t is: every
party scores the public subset S_t, the server averages the scores, every party digests (trains its logits
toward the consensus on S_t, mean absolute error) and revisits (trains on its private data). Over gRPC a
party receives the consensus on S_t only in the instructions of round t + 1, so round t + 1 digests and
revisits first and then scores S_{t+1}; the final evaluate round digests and revisits the consensus of the
last training round. Each party's sequence of updates is FedMD's; round 1 has nothing to digest and revisits
only (hetfed does not run FedMD's transfer-learning phase before round 1).
"""

from __future__ import annotations

import numpy as np
import torch

from hetfed.client.algorithms.base import ClientContext, ClientHalf
from hetfed.client.training import (
    Batch,
    Objective,
    PerExample,
    cross_entropy,
    epoch_batches,
    eval_mode,
    fit,
    trainable,
)
from hetfed.wire.payloads import EvalMetrics, Payload, Received, SeedPosteriors
from hetfed.wire.specs import fedmd
from hetfed.wire.specs.fedmd import FedMDConfig, public_subset


def digest_loss(logits: torch.Tensor, consensus: torch.Tensor) -> torch.Tensor:
    """Per example: the mean over the K classes of |f_k(x) − f̃(x)| (Keras' mean_absolute_error; its mean over
    a batch is the reference code's loss)."""
    return (logits - consensus).abs().mean(dim=1)


def digest_batches(x: torch.Tensor, size: int, epochs: int, batch_size: int,
                   rng: np.random.Generator) -> list[Batch]:
    """``epochs`` shuffled epochs of the subset in batches; each batch's ``y`` holds positions into the subset."""
    out: list[Batch] = []
    for _ in range(epochs):
        order = torch.as_tensor(rng.permutation(size), device=x.device)
        out.extend(Batch(x[order[s:s + batch_size]], order[s:s + batch_size]) for s in range(0, size, batch_size))
    return out


@fedmd.SPEC.client_half
class FedMDClient(ClientHalf[FedMDConfig]):
    """FedMD party: a private model that digests the consensus on public examples and revisits its own data."""

    # Under DP nothing would bound the logits on public examples that go up after training on private data:
    # this half does not serve [privacy].
    privacy_mechanism = None

    def __init__(self, ctx: ClientContext[FedMDConfig]) -> None:
        super().__init__(ctx)
        public = ctx.data.public
        if public is None:
            raise ValueError(f"fedmd needs a public (seed) set, and the data {ctx.data.name!r} has none; "
                             "use data.partition 'rotated'")
        self.cfg = ctx.config
        self.seed_set_id = public.id
        self.pub_x = torch.as_tensor(public.features(), device=ctx.device)

    def optimized(self) -> dict[str, list[torch.nn.Parameter]]:
        """The digest's optimiser and the revisit's, over the same parameters (two compiled models in the
        reference code, each with its own Adam)."""
        params = trainable(self.ctx.model)
        return {"opt_digest": params, "opt_revisit": params}

    def digest(self, received: SeedPosteriors | None, rng: np.random.Generator) -> float:
        """Train the logits toward the consensus on its subset for ``digest_epochs`` (0.0 with no consensus)."""
        if received is None or self.cfg.digest_epochs == 0:
            return 0.0
        n = self.pub_x.shape[0]
        idx, target = received.indices, received.probabilities
        k = self.ctx.data.num_classes
        if received.seed_set_id != self.seed_set_id:
            raise ValueError(f"the consensus refers to seed set {received.seed_set_id!r}, this organization holds "
                             f"{self.seed_set_id!r}")
        if idx.size == 0 or idx.min() < 0 or idx.max() >= n or target.shape != (idx.size, k):
            raise ValueError(f"the consensus does not fit the public set ({idx.size} indices, logits "
                             f"{list(target.shape)})")
        device = self.pub_x.device
        x = self.pub_x[torch.from_numpy(np.array(idx, dtype=np.int64)).to(device)]
        consensus = torch.from_numpy(np.array(target, dtype=np.float32)).to(device)
        term = PerExample(lambda batch, out: digest_loss(out.logits, consensus[batch.y]), name="digest_mae")
        batches = digest_batches(x, idx.size, self.cfg.digest_epochs, self.cfg.digest_batch_size, rng)
        return fit([Objective(self.ctx.model, self.optimizer("opt_digest"), [term])], batches).loss

    def revisit(self, rng: np.random.Generator) -> float:
        """``local_epochs`` epochs of cross-entropy on the private data."""
        objective = Objective(self.ctx.model, self.optimizer("opt_revisit"), [cross_entropy])
        return fit([objective], epoch_batches(self.ctx.train, self.cfg, rng)).loss

    @torch.no_grad()
    def scores(self, round_seed: int) -> SeedPosteriors:
        """The logits f_k(x) on the round's public subset (eval mode)."""
        idx = public_subset(round_seed, self.pub_x.shape[0], self.cfg.public_subset)
        model, at = self.ctx.model, torch.from_numpy(idx).to(self.pub_x.device)
        with eval_mode(model):
            logits = torch.cat([model(self.pub_x[at[s:s + 1024]]).float() for s in range(0, idx.size, 1024)])
        return SeedPosteriors(self.seed_set_id, idx, logits.cpu().numpy(), 0.0)

    def train(self, round_: int, round_seed: int, received: Received) -> list[Payload]:
        """Digest the last consensus and revisit, then send the logits on this round's subset and metrics."""
        rng = self.ctx.rng(round_seed)
        digest = self.digest(received.maybe(SeedPosteriors), rng)
        loss = self.revisit(rng)
        metrics = self.ctx.metrics(loss, evaluated_round=round_, extra={"digest_loss": digest})
        return [self.scores(round_seed), metrics]

    def evaluate(self, round_: int, received: Received) -> EvalMetrics:
        """Digest the last training round's consensus and revisit, then the model on every test set."""
        rng = self.ctx.rng(round_)
        digest = self.digest(received.maybe(SeedPosteriors), rng)
        loss = self.revisit(rng)
        return self.ctx.metrics(loss, evaluated_round=round_ - 1, extra={"digest_loss": digest})
