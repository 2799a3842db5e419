"""An organization's own architecture: builders named "package.module:function" go through the built-ins' path."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hetfed.client.algorithms import client_half_type
from hetfed.client.algorithms.fedsr.losses import ProbabilisticSplitModel
from hetfed.client.algorithms.simfed.layers import FactorizedConv2d, FactorizedLinear, build_factorized_model
from hetfed.client.model_registry import MODELS
from hetfed.client.models import (
    OWN_LATENT_DIM,
    ModelBuilderError,
    SplitModel,
    build_model,
    default_latent_dim,
    encoder_builder,
)
from hetfed.wire.specs import get_spec

SHAPE = (1, 28, 28)


def test_an_own_builder_gets_hetfeds_head_and_the_runs_seed() -> None:
    a = build_model("tests.ownpkg.models:tiny_cnn", SHAPE, 10, latent_dim=16, seed=3)
    b = build_model("tests.ownpkg.models:tiny_cnn", SHAPE, 10, latent_dim=16, seed=3)
    c = build_model("tests.ownpkg.models:tiny_cnn", SHAPE, 10, latent_dim=16, seed=4)
    assert isinstance(a, SplitModel) and (a.latent_dim, a.num_classes) == (16, 10)
    assert isinstance(a.head, nn.Linear) and (a.head.in_features, a.head.out_features) == (16, 10)
    for (name, p), q, r in zip(a.state_dict().items(), b.state_dict().values(), c.state_dict().values(), strict=True):
        assert torch.equal(p, q), name
        if p.ndim > 1:  # convolution and linear weights (BatchNorm starts at ones and zeros whatever the seed)
            assert not torch.equal(p, r), name
    assert a(torch.zeros(5, *SHAPE)).shape == (5, 10)


def test_built_ins_are_builders_on_the_same_path() -> None:
    """A registry entry names a builder; naming that builder directly builds the same weights."""
    by_name = build_model("lenet", SHAPE, 10, seed=1)
    by_ref = build_model(MODELS["lenet"].builder, SHAPE, 10, latent_dim=MODELS["lenet"].latent_dim, seed=1)
    for p, q in zip(by_name.state_dict().values(), by_ref.state_dict().values(), strict=True):
        assert torch.equal(p, q)


def test_latent_width_from_the_config_the_builder_or_hetfeds_default() -> None:
    assert default_latent_dim("tests.ownpkg.models:tiny_mlp") == 24  # the builder's attribute
    assert default_latent_dim("tests.ownpkg.models:tiny_cnn") == OWN_LATENT_DIM == 64
    assert default_latent_dim("lenet") == 84
    assert build_model("tests.ownpkg.models:tiny_mlp", SHAPE, 10).latent_dim == 24
    assert build_model("tests.ownpkg.models:tiny_mlp", SHAPE, 10, latent_dim=7).latent_dim == 7


def test_a_whole_model_keeps_the_organizations_head() -> None:
    model = build_model("tests.ownpkg.models:whole", SHAPE, 10, latent_dim=12)
    assert isinstance(model, SplitModel)
    assert model.head.bias is None and model.head.weight.shape == (10, 12)
    assert model(torch.zeros(2, *SHAPE)).shape == (2, 10)


def test_bounded_latent_is_checked() -> None:
    z = build_model("tests.ownpkg.models:tiny_cnn", SHAPE, 10, latent_dim=8, bounded_latent=True).embed(
        torch.randn(4, *SHAPE))
    assert bool(((z >= 0) & (z <= 1)).all())
    with pytest.raises(ModelBuilderError, match=r"bounded latent in \[0, 1\].*nn.Sigmoid"):
        build_model("tests.ownpkg.models:unbounded", SHAPE, 10, latent_dim=8, bounded_latent=True)


@pytest.mark.parametrize(("ref", "message"), [
    ("tests.ownpkg.broken:anything",
     "model builder 'tests.ownpkg.broken:anything': cannot import module 'tests.ownpkg.broken' (ImportError: "
     "libcudnn.so.9: cannot open shared object file)"),
    ("tests.ownpkg.nosuch:f",
     "model builder 'tests.ownpkg.nosuch:f': cannot import module 'tests.ownpkg.nosuch' (ModuleNotFoundError: "
     "No module named 'tests.ownpkg.nosuch')"),
    ("tests.ownpkg.models:nosuch", "model builder 'tests.ownpkg.models:nosuch': module 'tests.ownpkg.models' has "
     "no function 'nosuch'"),
    ("tests.ownpkg.models:raises", "model builder 'tests.ownpkg.models:raises' raised RuntimeError for input shape "
     "(1, 28, 28), latent_dim 16: no GPU-only layer here"),
    ("tests.ownpkg.models:not_a_module", "model builder 'tests.ownpkg.models:not_a_module' returned dict, not a "
     "torch.nn.Module"),
    ("tests.ownpkg.models:wrong_width", "model 'tests.ownpkg.models:wrong_width': the encoder must map a batch of "
     "inputs (1, 28, 28) to (batch, latent_dim) = (2, 16) on a probe batch, got (2, 19)"),
    ("nosuchmodel", "unknown model 'nosuchmodel'; available: "),
])
def test_a_builder_that_cannot_serve_is_refused_in_one_line(ref: str, message: str) -> None:
    with pytest.raises(ModelBuilderError) as info:
        build_model(ref, SHAPE, 10, latent_dim=16)
    assert str(info.value).startswith(message)
    assert "\n" not in str(info.value)


def test_an_encoder_that_fails_on_the_input_shape_is_refused() -> None:
    with pytest.raises(ModelBuilderError, match=r"raised ValueError for input shape \(60,\)"):
        build_model("tests.ownpkg.models:tiny_cnn", (60,), 10, latent_dim=4)
    assert encoder_builder("tests.ownpkg.models:tiny_cnn").__name__ == "tiny_cnn"


def test_algorithms_wrap_an_own_builder_as_they_wrap_built_ins() -> None:
    """SimFed factorises every Linear and Conv2d of the encoder; FedSR makes it probabilistic."""
    simfed = build_factorized_model("tests.ownpkg.models:tiny_cnn", SHAPE, 10, latent_dim=16, seed=0)
    kinds = {type(m) for m in simfed.encoder.modules()}
    assert FactorizedConv2d in kinds and FactorizedLinear in kinds
    assert not any(type(m) in (nn.Linear, nn.Conv2d) for m in simfed.encoder.modules())
    spec = get_spec("fedsr")
    config = spec.parse({}, "fedsr")
    fedsr = client_half_type(spec).make_model("tests.ownpkg.models:tiny_cnn", SHAPE, 10, seed=0, latent_dim=16,
                                              bounded_latent=False, config=config)
    assert isinstance(fedsr, ProbabilisticSplitModel)
    assert fedsr(torch.zeros(3, *SHAPE)).shape == (3, 10)
