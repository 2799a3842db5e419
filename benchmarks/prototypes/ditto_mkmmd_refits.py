"""How MK-MMD's kernel weights β are refit under the two schedules, on one organization for one local epoch.

    python benchmarks/prototypes/ditto_mkmmd_refits.py

Builds Ditto+MK-MMD's real client half as ``benchmarks/ditto_round_cost.py`` does (Synthetic(0.5, 0.5),
organization 0, tuning seed 100, the reproduction's settings) and trains one epoch with refits every 20 steps
(MK-MMD₂₀, s = 5) and on every step (MK-MMD₋₁), counting how each refit ended (``qp``, ``single_kernel``,
``kept``) and how many distinct β it produced. The results page quotes it to show that the two schedules do
fit different kernel weights although they end at nearly the same accuracy.
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np
import torch

from hetfed.client.algorithms import ClientContext, make_client_half
from hetfed.client.algorithms.ditto import mkmmd as losses
from hetfed.client.data import DataConfig, load_client_data
from hetfed.client.models import build_model
from hetfed.wire.payloads import Received
from hetfed.wire.specs import get_spec


def refits(refit_every: int, seed: int = 100) -> tuple[dict[str, int], int]:
    """(refit outcomes by kind, distinct β) of one local epoch with ``refit_every``."""
    outcomes: collections.Counter[str] = collections.Counter()
    betas: set[tuple[float, ...]] = set()
    original = losses.MkMmdLoss._set_beta

    def spy(self: Any, d_hat: torch.Tensor, q_hat: torch.Tensor) -> Any:
        how = original(self, d_hat, q_hat)
        outcomes[how] += 1
        betas.add(tuple(np.round(self.beta.numpy(), 6)))
        return how

    losses.MkMmdLoss._set_beta = spy  # type: ignore[method-assign]
    try:
        spec = get_spec("ditto_mkmmd")
        data = load_client_data(DataConfig(dataset="synthetic", partition="natural", num_clients=8, client_index=0,
                                           seed=seed))
        cfg = spec.config(local_epochs=1, batch_size=10, lr=0.001, momentum=0.9, weight_decay=0.001, lam=0.01,
                          mu=1.0, refit_every=refit_every, refit_batches=5)

        def build() -> torch.nn.Module:
            return build_model("linear", data.input_shape, data.num_classes, seed=seed)

        ctx = ClientContext("org-0", build(), data, torch.device("cpu"), cfg, seed, build_model=build)  # type: ignore[arg-type]
        make_client_half(spec, ctx).train(1, 1, Received([], frozenset()))
    finally:
        losses.MkMmdLoss._set_beta = original  # type: ignore[method-assign]
    return dict(outcomes), len(betas)


def main() -> None:
    torch.set_num_threads(1)
    for every in (20, -1):
        outcomes, distinct = refits(every)
        print(f"refit_every = {every:>3}: refits {outcomes}, distinct β {distinct}")


if __name__ == "__main__":
    main()
