"""Every algorithm's experiment settings, by the spec's name (an algorithm without an entry gets none).

A preset (``ditto_cos``, ``fedl2r``) shares the entry of the algorithm it presets unless it has its own.
"""

from __future__ import annotations

from hetfed.cli.experiments.base import ANY_DATASET, Experiment, FigureLabel, LocalDefaults
from hetfed.wire.specs import AlgorithmSpec

# What ``hetfed run`` compares when the user names no algorithm: the federated baseline against local training.
DEFAULT_COMPARISON: tuple[str, ...] = ("fedavg", "local")

EXPERIMENTS: dict[str, Experiment] = {
    # Every organization sends and receives the whole model: what reports compare other algorithms' bytes with.
    "fedavg": Experiment(bytes_reference="FedAvg"),
    "fedcma": Experiment(
        defaults={
            # The point of Fed-CMA is heterogeneous encoders: organizations alternate a CNN and an MLP.
            ANY_DATASET: LocalDefaults(models=("fedgen_cnn", "mlp"), latent_dim=32),
            "synthetic": LocalDefaults(models=("mlp",)),
            # The 2-D toy: a 2-D latent space to draw, and enough local steps for the alignment to act.
            "gauss4": LocalDefaults(models=("mlp",), latent_dim=2, rounds=30, config={"lr": 0.1, "local_steps": 10}),
        },
        labels={"global_head": FigureLabel(
            "encoder + v̄", "each organization's private encoder with the global head v̄, on its own test set")},
        docs="algorithms/fedcma.md",
    ),
    "fedh2l": Experiment(
        defaults={
            # One round is one iteration of Algorithm 1 (one local and one mutual-learning step), so many rounds;
            # four different architectures, as the paper mixes networks. The optimiser is its config's (AMSGrad).
            ANY_DATASET: LocalDefaults(rounds=500, models=("lenet", "mlp", "fedgen_cnn", "lenet_wide"),
                                       partition="rotated"),
        },
        labels={
            "wdp": FigureLabel("WDP", "within-domain performance: accuracy on the own domain's test set"),
            "cdp": FigureLabel("CDP", "cross-domain performance: the other domains' test sets"),
            "acc": FigureLabel("ACC", "accuracy on every domain's test set"),
        },
        docs="algorithms/fedh2l.md",
    ),
    "fedsr": Experiment(
        defaults={
            # Rotated MNIST leave one domain out with the paper's network (z = 64) and 100 rounds of E = 5 steps.
            "mnist5k": LocalDefaults(rounds=100, models=("rmnist_cnn",), latent_dim=64, partition="rotated_lodo"),
        },
        labels={
            "target": FigureLabel("target acc", "accuracy on the held-out target domain (every organization holds "
                                                "the same global model)"),
            "source_val": FigureLabel("source val acc", "accuracy on the organizations' own validation splits "
                                                        "(what settings are chosen on)"),
        },
        docs="algorithms/fedsr.md",
    ),
    "simfed": Experiment(
        defaults={
            # 20 rounds of its config's 5 local epochs train MNIST-5k's small organizations about as far as the
            # tuning runs needed (docs/algorithms/simfed.md).
            ANY_DATASET: LocalDefaults(models=("lenet",), rounds=20),
            # The feature vectors take the MLP (LeNet needs images); gauss4's 2-D latent space is drawn.
            "synthetic": LocalDefaults(models=("mlp",)),
            "gauss4": LocalDefaults(models=("mlp",), latent_dim=2),
        },
        labels={
            "mask_density": FigureLabel("sent mask density",
                                        "share of the mask entries an organization sent in its last upload"),
            "trained_mask_density": FigureLabel(
                "trained mask density", "share of the non-zero entries of the mask an organization trained (sent "
                                        "or not)"),
        },
        docs="algorithms/simfed.md",
    ),
    "ditto": Experiment(
        defaults={
            # Synthetic's own defaults are the paper's Appendix C setup (experiments/datasets.py); Ditto adds the
            # width of its Linear(60, 20) → Linear(20, 10) network.
            "synthetic": LocalDefaults(latent_dim=20),
        },
        labels={"global": FigureLabel(
            "global model", "the averaged global model w̄ on each organization's own test set (FedAvg's model)")},
        docs="algorithms/ditto.md",
    ),
}


def experiment(spec: AlgorithmSpec) -> Experiment:
    """The experiment settings of ``spec``: its own entry, else its family's (a preset's algorithm), else none."""
    found = EXPERIMENTS.get(spec.name) or EXPERIMENTS.get(spec.family)
    return found if found is not None else Experiment()


def docs_page(spec: AlgorithmSpec) -> str:
    """The algorithm's page under docs/ (a preset shares its algorithm's)."""
    return experiment(spec).docs or f"algorithms/{spec.family}.md"


def bytes_reference() -> tuple[str, str]:
    """(name, label) of the algorithm whose bytes per round reports compare every run's with; ("", "") if none."""
    for name, entry in EXPERIMENTS.items():
        if entry.bytes_reference:
            return name, entry.bytes_reference
    return "", ""
