"""Every algorithm that sums its uploads can fix its secure round's encoding before the round: each summed kind is
declared at Join (``shared_schema``) or its server half gives the shapes from its config (``summed_shapes``).
Without either, a secure run fails at its first stage call ("no organization declared")."""

from __future__ import annotations

import numpy as np
import pytest

from hetfed.aggregator.algorithms import make_server_half
from hetfed.aggregator.algorithms.base import RunInfo
from hetfed.aggregator.run.secure import SecureParams
from hetfed.aggregator.run.secure_stages import SecureStages
from hetfed.aggregator.run.state import Rules, RunState
from hetfed.wire.contract import TensorDecl
from hetfed.wire.errors import WireError
from hetfed.wire.payloads import ClassMeanEmbeddings, HeadWeights, PayloadKind
from hetfed.wire.phases import Phase
from hetfed.wire.specs import REGISTERED, AlgorithmSpec, fedavg
from hetfed.wire.summation import shapes

SUMMING = [s for s in REGISTERED if s.summed_upload]


@pytest.mark.parametrize("spec", SUMMING, ids=lambda s: s.name)
def test_every_summed_kind_has_its_shapes_before_the_round(spec: AlgorithmSpec) -> None:
    half = make_server_half(spec, spec.config(), RunInfo(0, ("a", "b")))
    given = half.summed_shapes()
    undeclared = spec.summed_upload - spec.shared_schema
    assert not undeclared or {name.partition("/")[0].partition("#")[0] for name in given} == \
        {kind.value for kind in spec.summed_upload}, f"{spec.name} sums {sorted(k.value for k in undeclared)}"


def test_fedcmas_shapes_are_its_uploads_summed_form() -> None:
    """K × d_e from the run's config: the class means with one weight per class, the head with one weight."""
    spec = next(s for s in SUMMING if s.name == "fedcma")
    config = spec.config(latent_dim=5, num_classes=4)
    given = make_server_half(spec, config, RunInfo(0, ("a",))).summed_shapes()
    counts = np.array([3, 0, 1, 2], np.int64)
    upload = [ClassMeanEmbeddings(np.arange(4, dtype=np.int64), np.zeros((4, 5), np.float32), counts, counts > 0),
              HeadWeights(np.zeros((4, 5), np.float32), np.zeros(4, np.float32), 6)]
    assert given == {name: shape for p in upload for name, shape in shapes(p).items()}
    assert given == {"class_mean_embeddings/means": (4, 5), "class_mean_embeddings#weight": (4,),
                     "head_weights/weight": (4, 5), "head_weights/bias": (4,), "head_weights#weight": ()}


def test_a_half_without_shapes_takes_them_from_the_declared_schema() -> None:
    """FedAvg gives none: its round's shapes come from the tensors declared at Join; with none declared, no round."""
    half = make_server_half(fedavg.SPEC, fedavg.SPEC.config(), RunInfo(0, ("a", "b")))
    assert half.summed_shapes() == {}
    rules = Rules("r", ("a", "b"), 1, 2, True, Phase.TRAIN)
    stages = SecureStages(fedavg.SPEC, rules, 0, 10.0, SecureParams())
    with pytest.raises(WireError) as err:
        stages.current(RunState.start(rules), lambda: half)
    assert err.value.reason == "missing_payload" and "no organization declared" in str(err.value)
    declared = RunState(Phase.TRAIN, 1, schema={PayloadKind.MODEL_WEIGHTS: {"w": TensorDecl("float32", (2, 3))}})
    fields = {f.name: f.shape for f in stages.current(declared, lambda: half).config.encoding.fields}
    assert fields == {"model_weights/w": (2, 3), "model_weights#weight": ()}
