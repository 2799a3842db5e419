"""Rotated MNIST from MNIST-5k and the shared seed set: rotation, splits, fingerprint, files, config checks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hetfed.client.data import DataConfig, load_client_data
from hetfed.client.data.rotated import build_seed_set, load_seed_set, rotate_clockwise
from hetfed.client.data.seedset import SeedSet, fingerprint


def cfg(**kw: object) -> DataConfig:
    return DataConfig(**{"dataset": "mnist5k", "partition": "rotated", "num_clients": 4, **kw})  # type: ignore[arg-type]


def test_rotation_is_clockwise_and_matches_scipy() -> None:
    img = np.zeros((1, 1, 5, 5))
    img[0, 0, 0, 2] = 1.0  # top centre
    np.testing.assert_allclose(rotate_clockwise(img, 90)[0, 0, 2, 4], 1.0)  # -> right centre
    np.testing.assert_array_equal(rotate_clockwise(img, 0), img)
    ndimage = pytest.importorskip("scipy.ndimage")
    x = np.random.default_rng(0).random((2, 1, 28, 28))
    for angle in (20, 40, 60):
        ref = ndimage.rotate(x, -angle, axes=(2, 3), reshape=False, order=1, mode="grid-constant", prefilter=False)
        np.testing.assert_allclose(rotate_clockwise(x, angle), ref, atol=1e-12)


def test_domains_splits_and_test_sets() -> None:
    parts = [load_client_data(cfg(client_index=i)) for i in range(4)]
    seeds = parts[0].public
    assert seeds is not None and len(seeds) == 400 and seeds.ranges() == {d: (100 * d, 100 * (d + 1)) for d in range(4)}
    for i, d in enumerate(parts):
        assert d.domain == i and d.seed_set == (seeds.id, seeds.sha256)
        assert (len(d.train), len(d.test), len(d.global_test), len(d.cross_test)) == (650, 150, 600, 450)
        assert np.bincount(d.train.y).tolist() == [65] * 10 and np.bincount(d.test.y).tolist() == [15] * 10
        assert set(d.cross_test.domain.tolist()) == set(range(4)) - {i}
        assert d.public is not None and d.public.sha256 == seeds.sha256  # every organization holds the same set
    # One base image, one role, in every domain: M20's private images are M0's private images rotated.
    base = parts[0].train.x
    np.testing.assert_allclose(parts[1].train.x, np.rint(rotate_clockwise(np.rint(base * 255), 20)).clip(0, 255) / 255,
                               atol=1e-6)
    # No test image appears, in any rotation, among the private or public images.
    test0 = {a.tobytes() for a in parts[0].test.x}
    assert not test0 & {a.tobytes() for a in parts[0].train.x}
    assert not test0 & {a.tobytes() for a in seeds.features()[seeds.part(0)]}
    agg = load_client_data(cfg(client_index=2, train_on_public=True))
    assert len(agg.train) == 650 + 400 and "seed set" in agg.name


def test_seed_set_depends_on_seed_and_alpha_and_round_trips_through_a_file(tmp_path: Path) -> None:
    a = build_seed_set(cfg())
    assert build_seed_set(cfg()).sha256 == a.sha256
    assert build_seed_set(cfg(seed=1)).sha256 != a.sha256
    b = build_seed_set(cfg(public_fraction=0.05))
    assert len(b) == 200 and b.id != a.id
    a.save(tmp_path / "seed.npz")
    loaded = load_seed_set(cfg(seed_set_path=str(tmp_path / "seed.npz")))
    assert (loaded.id, loaded.sha256) == (a.id, a.sha256)
    np.testing.assert_array_equal(loaded.x, a.x)
    x = a.x.copy()
    x[5, 0, 3, 3] ^= 1
    assert SeedSet(a.id, x, a.y, a.domain).sha256 != a.sha256  # one pixel changes the fingerprint
    assert fingerprint(a.x, a.y, a.domain) == a.sha256
    with pytest.raises(ValueError, match="uint8"):
        SeedSet("s", a.x.astype(np.float32), a.y, a.domain)
    with pytest.raises(FileNotFoundError):
        SeedSet.load(tmp_path / "missing.npz")


def test_config_checks() -> None:
    with pytest.raises(ValueError, match="public_fraction"):
        cfg(public_fraction=0.8)
    with pytest.raises(ValueError, match="rotated"):
        DataConfig(dataset="mnist5k", partition="iid", train_on_public=True)
    with pytest.raises(ValueError, match="not available for dataset 'digits'"):
        DataConfig(dataset="digits", partition="rotated")


def test_nearest_rotation_has_its_own_seed_set() -> None:
    from hetfed.client.data.rotated import rotate_nearest

    default, nearest = load_client_data(cfg(client_index=2)), load_client_data(cfg(client_index=2, rotation="nearest"))
    assert default.public is not None and nearest.public is not None
    assert default.public.id == "rotated-mnist5k-d4-a0.1-s0" and nearest.public.id == "rotated-mnist5k-d4-a0.1-s0-nearest"
    assert default.public.sha256 != nearest.public.sha256 and "M40, nearest" in nearest.name
    m0 = load_client_data(cfg(client_index=0, rotation="nearest"))
    np.testing.assert_array_equal(m0.train.x, load_client_data(cfg(client_index=0)).train.x)  # M0 is not rotated
    stored = np.rint(m0.train.x * 255).astype(np.uint8)
    # Clockwise by 40° (FedH2L's direction): PIL's rotate by -40.
    np.testing.assert_array_equal(nearest.train.x, rotate_nearest(stored, -40).astype(np.float32) / np.float32(255.0))
