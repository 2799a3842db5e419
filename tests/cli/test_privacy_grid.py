"""The privacy grid's distributed-DP row: a method's ``epsilon_config`` sets algorithm fields per privacy budget
(Fed-CMA's share of the budget for its class sums, ``ddp_epsilon``), under DP only."""

from __future__ import annotations

from hetfed.cli.reproduce.grids import load_grid
from hetfed.cli.reproduce.measuring import federation_options


def test_fedcma_secure_plans_its_class_sums_share_per_budget_under_secure_aggregation() -> None:
    grid = load_grid("privacy")
    method = grid.method("fedcma_secure")
    local = grid.method("fedcma")
    for budget, share in ((1, 0.8), (3, 2.3), (8, 4.0)):
        opts = federation_options(grid, method, {"epsilon": budget}, 0, artifacts=False)
        config = opts.extra_algorithm_config[method.algorithm]
        assert opts.secure_aggregation and opts.privacy == {"clip_norm": 1.0, "epsilon_budget": budget}
        assert config == {**local.config, "ddp_epsilon": share, "ddp_delta": 1e-8}
        plain = federation_options(grid, local, {"epsilon": budget}, 0, artifacts=False)
        assert not plain.secure_aggregation and plain.extra_algorithm_config[local.algorithm] == local.config
        assert (opts.models, opts.latent_dim, opts.rounds) == (plain.models, plain.latent_dim, plain.rounds)
    off = federation_options(grid, method, {"epsilon": 0}, 0, artifacts=False)
    assert off.privacy == {} and "ddp_epsilon" not in off.extra_algorithm_config[method.algorithm]
