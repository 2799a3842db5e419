"""fedgen_head's experiment side: its `hetfed run` defaults and its page (FedGen's).

Its spec is :data:`hetfed.wire.specs.fedgen.HEAD_SPEC` (FedGen sharing the head alone).
"""

from __future__ import annotations

from hetfed.cli.experiments.base import ANY_DATASET, Experiment, LocalDefaults
from hetfed.wire.specs.fedgen import HEAD_SPEC as SPEC

__all__ = ["EXPERIMENT", "SPEC"]

EXPERIMENT = Experiment(
    defaults={
        # Sharing the head alone, organizations may differ: they alternate the reference code's CNN and an MLP,
        # both ending in the generator's 32-wide latent (hetfed's own choice; Fed-CMA's Table 2 gives every
        # client FedGen's CNN, which --models fedgen_cnn sets).
        ANY_DATASET: LocalDefaults(models=("fedgen_cnn", "mlp"), latent_dim=32),
        "synthetic": LocalDefaults(models=("mlp",)),
        "gauss4": LocalDefaults(models=("mlp",), latent_dim=2),
    },
    docs="algorithms/fedgen.md",
)
