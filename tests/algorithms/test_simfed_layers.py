"""SimFed's factorised layers against float64 references, the mask's L1 gradient, the sparse codec, criteria inputs."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from hetfed.client.algorithms.simfed.layers import (
    FactorizedConv2d,
    FactorizedLinear,
    MaskL1,
    build_factorized_model,
    criteria_embeddings,
    criteria_inputs,
    densify_model,
    encode_factors,
    encode_mask,
    factorize_model,
    factorized_layers,
    load_factors,
    mask_density,
)
from hetfed.client.models import build_model, load_state_arrays, state_arrays
from hetfed.wire.specs.simfed import decode_mask


def _fill(layer: FactorizedLinear | FactorizedConv2d, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    u = rng.standard_normal(tuple(layer.u.shape))
    v = rng.standard_normal(tuple(layer.v.shape))
    m = rng.standard_normal(layer.mask_shape) * (rng.random(layer.mask_shape) < 0.3)
    with torch.no_grad():
        layer.u.copy_(torch.from_numpy(u))
        layer.v.copy_(torch.from_numpy(v))
        assert layer.mask is not None
        layer.mask.copy_(torch.from_numpy(m))
        if layer.bias is not None:
            layer.bias.copy_(torch.from_numpy(rng.standard_normal(tuple(layer.bias.shape))))
    return u, v, m


def test_factorized_dense_equals_the_dense_layer_it_represents() -> None:
    layer = FactorizedLinear(4, 3).double()
    u, v, m = _fill(layer, 0)
    w = np.outer(u, v) + m  # eq. 5, paper orientation [I, O]; ⊕ is addition
    x = np.random.default_rng(1).standard_normal((5, 4))
    b = layer.bias.detach().numpy()  # type: ignore[union-attr]
    got = layer(torch.from_numpy(x)).detach().numpy()
    np.testing.assert_allclose(got, x @ w + b, rtol=1e-13, atol=1e-13)
    np.testing.assert_array_equal(layer.dense_weight().detach().numpy(), w.T)
    # One entry by hand: W[2, 1] = u_2·v_1 + μ_21.
    assert layer.factor_matrix()[2, 1].item() == u[2] * v[1] + m[2, 1]
    dense = nn.Linear(4, 3).double()
    with torch.no_grad():
        dense.weight.copy_(torch.from_numpy(w.T))
        dense.bias.copy_(layer.bias)  # type: ignore[arg-type]
    np.testing.assert_allclose(got, dense(torch.from_numpy(x)).detach().numpy(), rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize(
    ("cin", "cout", "kernel", "stride", "padding", "groups"),
    [(2, 3, (3, 3), 1, 1, 1), (2, 4, (3, 2), 2, 0, 1), (4, 6, (3, 3), 1, 1, 2)],
)
def test_factorized_conv_equals_the_kernel_it_represents(
    cin: int, cout: int, kernel: tuple[int, int], stride: int, padding: int, groups: int
) -> None:
    layer = FactorizedConv2d(
        cin, cout, kernel, stride=(stride, stride), padding=(padding, padding), groups=groups
    )
    layer = layer.double()
    u, v, m = _fill(layer, 2)
    fh, fw = kernel
    i_per_group = cin // groups
    assert layer.mask_shape == (i_per_group * fh, cout * fw)
    # π by explicit loops: kernel[o, i, a, b] = u′[i·F_h + a]·v′[o·F_w + b] + μ′[i·F_h + a, o·F_w + b].
    ref = np.zeros((cout, i_per_group, fh, fw))
    for o in range(cout):
        for i in range(i_per_group):
            for a in range(fh):
                for b in range(fw):
                    ref[o, i, a, b] = u[i * fh + a] * v[o * fw + b] + m[i * fh + a, o * fw + b]
    np.testing.assert_array_equal(layer.dense_weight().detach().numpy(), ref)
    x = torch.from_numpy(np.random.default_rng(3).standard_normal((2, cin, 7, 6)))
    want = F.conv2d(x, torch.from_numpy(ref), layer.bias, stride, padding, 1, groups)
    np.testing.assert_allclose(layer(x).detach().numpy(), want.detach().numpy(), rtol=1e-12, atol=1e-12)


def test_factorize_model_replaces_encoder_layers_keeps_head_and_is_seeded() -> None:
    dense = build_model("lenet", (1, 28, 28), 10, seed=5)
    before = {k: t.clone() for k, t in dense.state_dict().items()}
    fact = factorize_model(dense, seed=5)
    for k, t in dense.state_dict().items():  # the original model is untouched
        assert torch.equal(t, before[k])
    names = [n for n, _ in factorized_layers(fact)]
    assert names == ["encoder.0", "encoder.3", "encoder.7", "encoder.9"]
    assert not factorized_layers(fact.head)  # the head stays a dense nn.Linear
    assert isinstance(fact.head, nn.Linear) and torch.equal(fact.head.weight, dense.head.weight)
    conv1 = dict(factorized_layers(fact))["encoder.0"]
    assert isinstance(conv1, FactorizedConv2d) and conv1.mask_shape == (1 * 5, 6 * 5)
    assert torch.equal(conv1.bias, dense.encoder[0].bias)  # type: ignore[arg-type]
    for _, layer in factorized_layers(fact):  # a sparse mask from the start: about 10% of the entries
        assert layer.mask is not None and 0.05 < float((layer.mask != 0).double().mean()) < 0.16
    rank1 = factorize_model(dense, seed=5, mask_density=0.0)
    assert all(float(layer.mask.detach().abs().sum()) == 0.0 for _, layer in factorized_layers(rank1))  # type: ignore[union-attr]
    assert fact(torch.zeros(2, 1, 28, 28)).shape == (2, 10)
    again = build_factorized_model("lenet", (1, 28, 28), 10, seed=5)
    other = build_factorized_model("lenet", (1, 28, 28), 10, seed=6)
    for (_, a), (_, b), (_, c) in zip(
        factorized_layers(fact), factorized_layers(again), factorized_layers(other), strict=True
    ):
        assert torch.equal(a.u, b.u) and torch.equal(a.v, b.v)
        assert not torch.equal(a.u, c.u)
    # W's entries have the variance of the replaced layer's initial weights (within sampling error).
    target = float(dense.encoder[7].weight.detach().double().var())
    for model in (fact, rank1):
        fc1 = dict(factorized_layers(model))["encoder.7"]
        ratio = float(fc1.dense_weight().detach().double().var()) / target
        assert 0.6 < ratio < 1.6, ratio
        assert abs(float(fc1.dense_weight().detach().double().mean())) < 0.1 * target**0.5
    no_mask = factorize_model(dense, seed=5, masks=False)
    assert all(layer.mask is None for _, layer in factorized_layers(no_mask))


@pytest.mark.parametrize(("name", "shape"), [("lenet", (1, 28, 28)), ("mlp", (60,))])
def test_densify_model_writes_each_factorised_weight_as_the_dense_layer_it_computes(
    name: str, shape: tuple[int, ...]
) -> None:
    """What local snapshots hold for SimFed: the registered architecture with W = u × v ⊕ μ, so a model rebuilt by
    name loads it and computes what the factorised model does."""
    fact = build_factorized_model(name, shape, 10, seed=3)
    with torch.no_grad():  # a trained-looking state: every factor and mask entry non-zero
        for _, layer in factorized_layers(fact):
            for p in (layer.u, layer.v, layer.mask):
                assert p is not None
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.1)
    before = {k: t.clone() for k, t in fact.state_dict().items()}
    dense = densify_model(fact)
    for k, t in fact.state_dict().items():  # the factorised model is untouched
        assert torch.equal(t, before[k])
    assert not factorized_layers(dense)
    for qualified, layer in factorized_layers(fact):
        replaced = dense.get_submodule(qualified)
        assert torch.equal(replaced.weight, layer.dense_weight().detach())  # type: ignore[arg-type]
        assert torch.equal(replaced.bias, layer.bias)  # type: ignore[arg-type]
    plain = build_model(name, shape, 10, seed=0)
    load_state_arrays(plain, state_arrays(dense))  # the registered architecture's names and shapes
    x = torch.randn(8, *shape, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(plain(x), fact(x), rtol=1e-5, atol=1e-6)


def test_mask_l1_value_and_gradient() -> None:
    model = build_factorized_model("mlp", (3,), 2, latent_dim=2, seed=0)
    layers = dict(factorized_layers(model))
    m1 = np.array([[1.5, -2.0, 0.0], [0.25, 0.0, -0.5], [0.0, 0.0, 3.0]])
    with torch.no_grad():
        layers["encoder.1"].mask.zero_()  # type: ignore[union-attr]
        layers["encoder.1"].mask[:3, :3] = torch.from_numpy(m1)  # type: ignore[index]
        layers["encoder.3"].mask.zero_()  # type: ignore[union-attr]
        layers["encoder.3"].mask[0, 1] = -4.0  # type: ignore[index]
    term = MaskL1(0.5)(model)
    assert term.item() == pytest.approx(0.5 * (1.5 + 2.0 + 0.25 + 0.5 + 3.0 + 4.0), abs=1e-6)
    term.backward()
    g1 = layers["encoder.1"].mask.grad  # type: ignore[union-attr]
    assert g1 is not None
    np.testing.assert_array_equal(g1[:3, :3].numpy(), 0.5 * np.sign(m1))
    assert float(g1[3:].abs().sum()) == 0.0  # |μ| has gradient 0 at μ = 0
    g2 = layers["encoder.3"].mask.grad  # type: ignore[union-attr]
    assert g2 is not None and g2[0, 1].item() == -0.5 and float(g2.abs().sum()) == 0.5
    assert layers["encoder.1"].u.grad is None  # the term touches the masks only
    assert (
        MaskL1(1.0)(factorize_model(build_model("mlp", (3,), 2, seed=0), seed=0, masks=False)).item() == 0.0
    )
    with pytest.raises(ValueError, match="lambda1"):
        MaskL1(-1.0)


def test_mask_threshold_and_sparse_round_trip() -> None:
    mask = np.array([[0.5, -0.001, 0.0], [0.002, -0.3, 0.0015]], dtype=np.float32)
    idx, val = encode_mask(mask, 0.0015)
    assert idx.dtype == np.int64 and val.dtype == np.float32
    np.testing.assert_array_equal(idx, [0, 3, 4])  # |0.0015| is not above the threshold: dropped
    np.testing.assert_array_equal(val, np.array([0.5, 0.002, -0.3], dtype=np.float32))
    np.testing.assert_array_equal(
        decode_mask(idx, val, (2, 3)), np.array([[0.5, 0, 0], [0.002, -0.3, 0]], np.float32)
    )
    idx0, val0 = encode_mask(mask, 0.0)  # threshold 0: every non-zero, decoded bit for bit
    np.testing.assert_array_equal(idx0, [0, 1, 3, 4, 5])
    np.testing.assert_array_equal(decode_mask(idx0, val0, mask.shape), mask)
    with pytest.raises(ValueError, match="strictly increasing"):
        decode_mask(np.array([3, 0]), np.ones(2, np.float32), (2, 3))
    with pytest.raises(ValueError, match="strictly increasing"):
        decode_mask(np.array([0, 6]), np.ones(2, np.float32), (2, 3))
    with pytest.raises(ValueError, match="one length"):
        decode_mask(np.array([0, 1]), np.ones(3, np.float32), (2, 3))
    with pytest.raises(ValueError, match="threshold"):
        encode_mask(mask, -1.0)


def test_encode_and_load_factors_round_trip() -> None:
    src = build_factorized_model("lenet", (1, 28, 28), 10, seed=1)
    for i, (_, layer) in enumerate(factorized_layers(src)):
        _fill(layer, 10 + i)
    sent = encode_factors(src, threshold=0.5, num_examples=42)
    assert sent.num_examples == 42 and [layer.name for layer in sent.layers] == [
        n for n, _ in factorized_layers(src)
    ]
    assert 0.0 < mask_density(sent) < 0.3
    dst = build_factorized_model("lenet", (1, 28, 28), 10, seed=2)
    load_factors(dst, sent)
    for (_, a), (_, b) in zip(factorized_layers(src), factorized_layers(dst), strict=True):
        assert torch.equal(a.u, b.u) and torch.equal(a.v, b.v)
        kept = torch.where(a.mask.abs() > 0.5, a.mask, torch.zeros_like(a.mask))  # type: ignore[union-attr]
        assert torch.equal(b.mask, kept)  # type: ignore[arg-type]
    bad = build_factorized_model("lenet_wide", (1, 28, 28), 10, seed=2)
    before = [layer.u.clone() for _, layer in factorized_layers(bad)]
    with pytest.raises(ValueError, match="shapes"):
        load_factors(bad, sent)
    assert all(torch.equal(b, layer.u) for b, (_, layer) in zip(before, factorized_layers(bad), strict=True))


def test_criteria_inputs_are_identical_for_a_seed_across_processes() -> None:
    x = criteria_inputs(7, (1, 28, 28), count=2)
    assert x.shape == (2, 1, 28, 28) and x.dtype == torch.float32
    assert torch.equal(x, criteria_inputs(7, (1, 28, 28), count=2))
    assert not torch.equal(x, criteria_inputs(8, (1, 28, 28), count=2))
    assert abs(float(x.mean())) < 0.1 and abs(float(x.std()) - 1.0) < 0.1
    script = textwrap.dedent("""
        import hashlib
        from hetfed.client.algorithms.simfed.layers import criteria_inputs
        print(hashlib.sha256(criteria_inputs(7, (1, 28, 28), count=2).numpy().tobytes()).hexdigest())
    """)
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    import hashlib

    assert out.stdout.strip() == hashlib.sha256(x.numpy().tobytes()).hexdigest()


def test_criteria_embeddings_use_eval_mode_and_restore_it() -> None:
    model = build_factorized_model("fedgen_cnn", (1, 28, 28), 10, seed=0)  # BatchNorm: modes differ
    model.train()
    with torch.no_grad():
        model(torch.randn(8, 1, 28, 28, generator=torch.Generator().manual_seed(0)))  # move running stats
    x = criteria_inputs(3, (1, 28, 28), count=4)
    z = criteria_embeddings(model, x)
    assert model.training
    model.eval()
    with torch.no_grad():
        want = model.embed(x).numpy()
    assert z.dtype == np.float32 and z.shape == (4, model.latent_dim)
    np.testing.assert_array_equal(z, want)
    model.train()
    with torch.no_grad():
        assert not np.allclose(model.embed(x).numpy(), z)  # train mode would have given other embeddings
