"""What ``hetfed run`` uses for each dataset by default, under the algorithm's defaults."""

from __future__ import annotations

from hetfed.cli.experiments.base import LocalDefaults

DATASET_DEFAULTS: dict[str, LocalDefaults] = {
    "mnist5k": LocalDefaults(partition="dirichlet", models=("lenet",)),
    "fmnist": LocalDefaults(partition="dirichlet", models=("lenet",)),
    "digits": LocalDefaults(partition="dirichlet", models=("lenet",)),
    # The Ditto+MMD paper's setup (Appendix C, Table 3's learning rate for (0.5, 0.5)): 15 rounds of 5 local
    # epochs, batch 10, SGD with momentum 0.9 and weight decay 1e-3 on Linear(60, 20) → Linear(20, 10).
    "synthetic": LocalDefaults(partition="natural", models=("linear",), rounds=15,
                               config={"local_epochs": 5, "batch_size": 10, "lr": 0.01, "momentum": 0.9,
                                       "weight_decay": 0.001}),
    "gauss4": LocalDefaults(partition="natural", models=("mlp",), latent_dim=2),
    "npz": LocalDefaults(partition="natural"),
    "imagefolder": LocalDefaults(partition="natural"),
    "torch": LocalDefaults(partition="natural"),
}


def dataset_defaults(dataset: str) -> LocalDefaults:
    """The local-run defaults of ``dataset`` (none for a dataset without an entry)."""
    return DATASET_DEFAULTS.get(dataset, LocalDefaults())
