"""Tests for hetfed.client.models: shapes, determinism, bounded latents, state arrays and torchvision handling."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from hetfed.client.models import (
    ModelUnavailableError,
    SplitModel,
    available_models,
    build_model,
    count_parameters,
    load_state_arrays,
    state_arrays,
)

LOCAL_MODELS = ["mlp", "mlp1", "lenet", "lenet_wide", "fedgen_cnn", "cnn_small", "cnn", "linear"]
DEFAULT_DIMS = {"mlp": 64, "mlp1": 256, "lenet": 84, "lenet_wide": 84, "fedgen_cnn": 32, "cnn_small": 60, "cnn": 128,
                "linear": 20}
REPO = Path(__file__).resolve().parents[2]
RMNIST_CNN_SEED0_ABS_SUM = 2102.909990477351  # sum of |state| of build_model("rmnist_cnn", (1, 28, 28), 10, seed=0)


def test_available_models() -> None:
    assert available_models() == [
        "mlp", "mlp1", "lenet", "lenet_wide", "fedgen_cnn", "cnn_small", "cnn", "rmnist_cnn", "rmnist_cnn_k5",
        "rmnist_dirt", "linear", "resnet18", "mobilenet_v2",
    ]


@pytest.mark.parametrize("name", LOCAL_MODELS)
@pytest.mark.parametrize("shape", [(1, 28, 28), (1, 8, 8), (3, 32, 32)])
def test_logits_and_latent_shapes(name: str, shape: tuple[int, int, int]) -> None:
    model = build_model(name, shape, 7)
    assert isinstance(model, SplitModel)
    x = torch.rand(5, *shape)
    assert model(x).shape == (5, 7)
    z = model.embed(x)
    assert z.shape == (5, DEFAULT_DIMS[name])
    assert model.latent_dim == DEFAULT_DIMS[name]
    assert isinstance(model.head, nn.Linear)
    assert (model.head.in_features, model.head.out_features) == (DEFAULT_DIMS[name], 7)
    torch.testing.assert_close(model(x), model.head(z))


def test_mlp_on_tabular_input_and_custom_latent() -> None:
    model = build_model("mlp", (60,), 10, latent_dim=20)
    assert model(torch.randn(3, 60)).shape == (3, 10)
    assert model.embed(torch.randn(3, 60)).shape == (3, 20)
    # Flatten -> Linear(60, 200) -> ReLU -> Linear(200, 20) -> ReLU, then head Linear(20, 10)
    assert count_parameters(model) == 60 * 200 + 200 + 200 * 20 + 20 + 20 * 10 + 10


def test_linear_is_the_ditto_papers_synthetic_network() -> None:
    model = build_model("linear", (60,), 10)
    # Linear(60, 20) -> Linear(20, 10) with nothing in between: the logits are an affine map of x.
    assert [type(m) for m in model.encoder] == [nn.Flatten, nn.Linear]
    assert count_parameters(model) == 60 * 20 + 20 + 20 * 10 + 10
    x = torch.randn(4, 60)
    w = model.head.weight @ model.encoder[1].weight
    b = model.head.weight @ model.encoder[1].bias + model.head.bias
    torch.testing.assert_close(model(x), x @ w.T + b)
    torch.testing.assert_close(model.embed(x), model.encoder[1](x))


def test_fedgen_cnn_matches_fedgen_mnist_config() -> None:
    model = build_model("fedgen_cnn", (1, 28, 28), 10)
    linears = [m for m in model.encoder.modules() if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(784, 32)]  # FedGen: hidden 784, latent 32
    convs = [m for m in model.encoder.modules() if isinstance(m, nn.Conv2d)]
    assert [(c.out_channels, c.kernel_size, c.stride) for c in convs] == [
        (6, (3, 3), (2, 2)),
        (16, (3, 3), (2, 2)),
    ]


@pytest.mark.parametrize("name", LOCAL_MODELS)
def test_bounded_latent_lies_in_unit_cube(name: str) -> None:
    shape = (1, 8, 8)
    model = build_model(name, shape, 10, latent_dim=16, bounded_latent=True)
    assert isinstance(list(model.encoder.children())[-1], nn.Sigmoid)
    z = model.embed(torch.randn(32, *shape) * 50).detach()
    assert z.shape == (32, 16)
    assert float(z.min()) >= 0.0
    assert float(z.max()) <= 1.0


@pytest.mark.parametrize("name", LOCAL_MODELS)
def test_same_seed_gives_bit_identical_weights(name: str) -> None:
    a = state_arrays(build_model(name, (1, 28, 28), 10, seed=3))
    b = state_arrays(build_model(name, (1, 28, 28), 10, seed=3))
    c = state_arrays(build_model(name, (1, 28, 28), 10, seed=4))
    assert a.keys() == b.keys()
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert any(not np.array_equal(a[k], c[k]) for k in a if a[k].dtype == np.float32)


def test_build_model_leaves_global_rng_alone() -> None:
    torch.manual_seed(123)
    before = torch.get_rng_state()
    build_model("lenet", (1, 28, 28), 10, seed=9)
    assert torch.equal(before, torch.get_rng_state())


def test_weights_identical_in_a_fresh_process() -> None:
    code = (
        "import numpy as np; from hetfed.client.models import build_model, state_arrays;"
        "s = state_arrays(build_model('fedgen_cnn', (1, 28, 28), 10, seed=5));"
        "print(repr(float(sum(np.float64(v.astype(np.float64).sum()) * (i + 1) for i, v in enumerate(s.values())))))"
    )
    env_path = ":".join(str(REPO / p) for p in ("proto", "services", "clients"))
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": env_path},
        timeout=120,
    )
    s = state_arrays(build_model("fedgen_cnn", (1, 28, 28), 10, seed=5))
    here = float(sum(np.float64(v.astype(np.float64).sum()) * (i + 1) for i, v in enumerate(s.values())))
    assert float(out.stdout.strip()) == here


def test_unknown_model_lists_available_names() -> None:
    with pytest.raises(ValueError, match="unknown model 'vgg'; available: mlp, mlp1, lenet, lenet_wide, fedgen_cnn, "
                       "cnn_small, cnn, rmnist_cnn, rmnist_cnn_k5, rmnist_dirt, linear, resnet18"):
        build_model("vgg", (1, 28, 28), 10)


def test_cnn_rejects_tabular_input() -> None:
    with pytest.raises(
        ValueError, match=r"model 'lenet' needs an image input shape \(C, H, W\), got \(60,\)"
    ):
        build_model("lenet", (60,), 10)


def test_state_arrays_dtypes_and_round_trip() -> None:
    source = build_model("fedgen_cnn", (1, 8, 8), 10, seed=0)
    source.train()
    source(torch.rand(4, 1, 8, 8))  # moves BatchNorm running statistics and num_batches_tracked
    arrays = state_arrays(source)
    assert arrays["encoder.1.num_batches_tracked"].dtype == np.int64
    assert int(arrays["encoder.1.num_batches_tracked"]) == 1
    assert all(v.dtype == np.float32 for k, v in arrays.items() if not k.endswith("num_batches_tracked"))
    assert set(arrays) == set(source.state_dict())

    target = build_model("fedgen_cnn", (1, 8, 8), 10, seed=1)
    load_state_arrays(target, arrays)
    again = state_arrays(target)
    assert all(np.array_equal(arrays[k], again[k]) for k in arrays)
    source.eval()
    target.eval()
    x = torch.rand(3, 1, 8, 8)
    assert torch.equal(source(x), target(x))
    arrays["head.bias"][:] = 7.0  # the arrays are copies, not views of the module
    assert float(source.head.bias.detach()[0]) != 7.0


def test_load_state_arrays_names_bad_keys_and_changes_nothing() -> None:
    model = build_model("mlp", (4,), 3, latent_dim=2, seed=0)
    arrays = state_arrays(model)
    before = state_arrays(model)
    missing = {k: v for k, v in arrays.items() if k != "head.bias"}
    with pytest.raises(ValueError, match=r"missing keys: head\.bias"):
        load_state_arrays(model, missing)
    with pytest.raises(ValueError, match="unexpected keys: extra"):
        load_state_arrays(model, {**arrays, "extra": np.zeros(1, dtype=np.float32)})
    bad = {**{k: v + 1 for k, v in arrays.items()}, "head.weight": np.zeros((2, 3), dtype=np.float32)}
    with pytest.raises(ValueError, match=r"head.weight: expected \(3, 2\), got \(2, 3\)"):
        load_state_arrays(model, bad)
    after = state_arrays(model)
    assert all(np.array_equal(before[k], after[k]) for k in before)
    # not strict: missing keys keep their values, unexpected keys are ignored
    load_state_arrays(model, {"head.bias": np.full(3, 2.0), "extra": np.zeros(1)}, strict=False)
    np.testing.assert_array_equal(state_arrays(model)["head.bias"], [2.0, 2.0, 2.0])
    np.testing.assert_array_equal(state_arrays(model)["head.weight"], before["head.weight"])


@pytest.mark.skipif(
    importlib.util.find_spec("torchvision") is not None, reason="torchvision is installed here"
)
@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2"])
def test_torchvision_models_unavailable_here(name: str) -> None:
    with pytest.raises(ModelUnavailableError, match="torchvision is not importable in this environment"):
        build_model(name, (1, 28, 28), 10)


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2"])
def test_torchvision_import_failure_is_model_unavailable(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchvision.models", None)  # makes the import raise ImportError
    with pytest.raises(
        ModelUnavailableError, match="install a torchvision build matching your torch"
    ) as info:
        build_model(name, (1, 28, 28), 10)
    assert isinstance(info.value, RuntimeError)


class _FakeResNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, kernel_size=7, stride=2, padding=3, bias=False)
        self.fc = nn.Linear(8, 1000)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(self.conv1(x), 1), 1))


class _FakeMobileNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False), nn.ReLU())
        )
        self.last_channel = 8
        self.classifier = nn.Linear(8, 1000)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(nn.functional.adaptive_avg_pool2d(self.features(x), 1), 1))


def test_torchvision_backbones_are_adapted(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = types.ModuleType("torchvision.models")
    fake.resnet18 = lambda weights=None: _FakeResNet()  # type: ignore[attr-defined]
    fake.mobilenet_v2 = lambda weights=None: _FakeMobileNet()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torchvision.models", fake)
    resnet = build_model("resnet18", (1, 28, 28), 10, latent_dim=16, bounded_latent=True)
    assert resnet.encoder[0].conv1.in_channels == 1
    assert isinstance(resnet.encoder[0].fc, nn.Identity)
    z = resnet.embed(torch.rand(2, 1, 28, 28)).detach()
    assert z.shape == (2, 16)
    assert float(z.min()) >= 0.0
    assert float(z.max()) <= 1.0
    mobile = build_model("mobilenet_v2", (1, 28, 28), 10, latent_dim=12)
    assert mobile.encoder[0].features[0][0].in_channels == 1
    assert mobile(torch.rand(2, 1, 28, 28)).shape == (2, 10)
    rgb = build_model("resnet18", (3, 32, 32), 10)
    assert rgb.encoder[0].conv1.in_channels == 3
    assert rgb.latent_dim == 128


def test_count_parameters_trainable_only() -> None:
    model = build_model("mlp", (4,), 3, latent_dim=2)
    total = count_parameters(model)
    assert total == 4 * 200 + 200 + 200 * 2 + 2 + 2 * 3 + 3
    for p in model.head.parameters():
        p.requires_grad_(False)
    assert count_parameters(model, trainable_only=True) == total - (2 * 3 + 3)


@pytest.mark.parametrize("shape", [(1, 28, 28), (1, 8, 8), (3, 32, 32), (1, 9, 9), (1, 10, 10), (1, 15, 15),
                                   (1, 16, 16), (1, 3, 3), (60,), (2,), (0, 28, 28)])
def test_the_registrys_input_check_agrees_with_every_builder(shape: tuple[int, ...]) -> None:
    """``hetfed run`` refuses a model the data does not fit from the registry alone (no torch); that check must
    say exactly what building the model would."""
    from hetfed.client.model_registry import MODELS, input_mismatch

    for name, entry in MODELS.items():
        if entry.vision:  # torchvision is absent here; their side is checked by the same _image_shape
            continue
        why = input_mismatch(name, shape)
        try:
            build_model(name, shape, 10, seed=0)
            built = True
        except ValueError:
            built = False
        assert built == (why is None), (name, shape, why)


def test_builtin_datasets_declare_the_input_shape_their_data_has() -> None:
    from hetfed.client.data import DATASETS, DataConfig, DatasetUnavailableError, load_client_data
    from hetfed.client.data.fmnist import check_available

    for name, entry in DATASETS.items():
        if not entry.builtin:
            continue
        if name == "fmnist":
            try:
                check_available()
            except DatasetUnavailableError:
                continue  # its loader's own tests cover the shape on files they write
        data = load_client_data(DataConfig(dataset=name, partition=next(iter(entry.partitions)), num_clients=4,
                                           client_index=0, seed=0))
        assert data.input_shape == entry.input_shape, name


# DIRT's Rotated MNIST network (atuannguyen/DIRT: domain_gen_rotatedmnist/models/dirt.py 12-25, 35).

def _xavier_bound(w: torch.Tensor) -> float:
    receptive = w[0][0].numel() if w.dim() > 2 else 1
    return float(np.sqrt(6.0 / (w.shape[1] * receptive + w.shape[0] * receptive)))


def test_rmnist_dirt_is_dirts_network() -> None:
    from torch.nn import functional as F

    from hetfed.client.models import ReLULinear

    model = build_model("rmnist_dirt", (1, 28, 28), 10, seed=0)
    enc = model.encoder
    assert [type(m) for m in enc] == [nn.Conv2d, nn.BatchNorm2d, nn.ReLU, nn.MaxPool2d] * 2 + [nn.Flatten, nn.Linear]
    convs, fc11, cls = [enc[0], enc[4]], enc[9], model.head
    assert [(c.in_channels, c.out_channels, c.kernel_size, c.bias) for c in convs] == [
        (1, 32, (5, 5), None), (32, 64, (5, 5), None)]
    assert (fc11.in_features, fc11.out_features) == (1024, 64) and type(cls) is ReLULinear
    assert (cls.in_features, cls.out_features) == (64, 10) and model.latent_dim == 64
    # 800 + 2·32 + 51,200 + 2·64 (BatchNorm) + 1024·64 + 64 (fc11) + 64·10 + 10 (the classifier).
    assert count_parameters(model) == 118_442
    # Xavier-uniform weights, |w| <= sqrt(6 / (fan_in + fan_out)), nearly reaching the bound (PyTorch's default
    # bounds 1/sqrt(fan_in): 0.2, 0.035, 0.031, 0.125 here, are all far from it), and zero biases.
    for w, bound in ((convs[0].weight, np.sqrt(6 / 825)), (convs[1].weight, 0.05), (fc11.weight, np.sqrt(6 / 1088)),
                     (cls.weight, np.sqrt(6 / 74))):
        assert _xavier_bound(w) == pytest.approx(bound, rel=1e-12)
        assert 0.97 * bound < float(w.detach().abs().max()) <= bound
    assert not fc11.bias.any() and not cls.bias.any()
    assert convs[0].weight.is_contiguous(memory_format=torch.channels_last)
    # logits = cls(relu(fc11(h))): the hand composition of the modules; z = fc11(h) itself has no activation.
    x = torch.rand(6, 1, 28, 28, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model.eval()
        z = fc11(enc[:9](x))
        expected = F.linear(F.relu(z), cls.weight, cls.bias)
        torch.testing.assert_close(model(x), expected, rtol=0, atol=0)
        torch.testing.assert_close(model.embed(x), z, rtol=0, atol=0)
        assert (z < 0).any() and not torch.allclose(model(x), F.linear(z, cls.weight, cls.bias))
    # The same seed, the same network; the run's class count sizes the classifier.
    again = build_model("rmnist_dirt", (1, 28, 28), 10, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values(),
                                                     strict=True))
    assert build_model("rmnist_dirt", (1, 28, 28), 7).head.out_features == 7


def test_rmnist_dirt_bounded_latent_makes_the_relu_the_identity() -> None:
    model = build_model("rmnist_dirt", (1, 28, 28), 10, latent_dim=8, bounded_latent=True, seed=2).eval()
    assert isinstance(model.encoder[-1], nn.Sigmoid)
    x = torch.rand(3, 1, 28, 28)
    with torch.no_grad():
        z = model.embed(x)
        assert z.shape == (3, 8) and ((z > 0) & (z < 1)).all()
        torch.testing.assert_close(model(x), nn.functional.linear(z, model.head.weight, model.head.bias))


def test_rmnist_cnn_is_unchanged() -> None:
    """The paper's 3×3 network keeps its modules and its PyTorch-default initialisation draws (runs depend on it)."""
    model = build_model("rmnist_cnn", (1, 28, 28), 10, seed=0)
    assert [type(m) for m in model.encoder] == [nn.Conv2d, nn.BatchNorm2d, nn.ReLU, nn.MaxPool2d] * 2 + [
        nn.Flatten, nn.Linear]
    assert type(model.head) is nn.Linear and model.encoder[9].in_features == 1600
    assert count_parameters(model) == 288 + 64 + 18_432 + 128 + 1600 * 64 + 64 + 650
    # Fingerprint of the seed-0 weights (equal to the tree before rmnist_dirt was added).
    sums = [float(np.abs(v.astype(np.float64)).sum()) for v in state_arrays(model).values()]
    assert sum(sums) == pytest.approx(RMNIST_CNN_SEED0_ABS_SUM, rel=1e-9)
