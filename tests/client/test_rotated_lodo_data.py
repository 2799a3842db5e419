"""Leave-one-domain-out Rotated MNIST: domains, the 90/10 split, the held-out target, the probe, config checks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hetfed.client.data import ClientData, DataConfig, load_client_data
from hetfed.client.data.rotated import rotate_clockwise
from hetfed.client.data.rotated_lodo import TARGET_SET, angle_of, source_domains


def cfg(**kw: object) -> DataConfig:
    return DataConfig(**{"dataset": "mnist5k", "partition": "rotated_lodo", "num_clients": 5, **kw})  # type: ignore[arg-type]


def ccw(images: np.ndarray, degrees: float) -> np.ndarray:
    """Stored 8-bit images rotated counter-clockwise like the loader does (float in [0, 1])."""
    return np.clip(np.rint(rotate_clockwise(np.rint(images * 255), -degrees)), 0, 255) / 255


def test_six_domains_five_sources_and_the_held_out_target() -> None:
    assert [angle_of(d) for d in range(6)] == [0, 15, 30, 45, 60, 75]
    assert source_domains(cfg(target_domain=0)) == [1, 2, 3, 4, 5]
    assert source_domains(cfg(target_domain=5)) == [0, 1, 2, 3, 4]
    assert source_domains(cfg(target_domain=2)) == [0, 1, 3, 4, 5]
    parts = [load_client_data(cfg(target_domain=2, client_index=i)) for i in range(5)]
    target = parts[0].extra_eval[TARGET_SET]
    for i, d in enumerate(parts):
        assert d.domain == [0, 1, 3, 4, 5][i]
        assert (len(d.train), len(d.test), len(d.extra_eval[TARGET_SET])) == (900, 100, 1000)
        assert np.bincount(d.train.y).tolist() == [90] * 10 and np.bincount(d.test.y).tolist() == [10] * 10
        assert np.bincount(d.extra_eval[TARGET_SET].y).tolist() == [100] * 10
        assert set(d.train.domain.tolist()) == set(d.test.domain.tolist()) == {d.domain}
        assert set(d.extra_eval[TARGET_SET].domain.tolist()) == {2}
        # Every organization evaluates on the same target images; none trains on them.
        np.testing.assert_array_equal(d.extra_eval[TARGET_SET].x, target.x)
        assert d.global_test is None and d.cross_test is None and d.public is None
        assert d.eval_sets().keys() == {TARGET_SET} and d.probe_set()[0] == TARGET_SET
        assert "target M30 held out" in d.name
    # The same base digits in every domain, rotated counter-clockwise by 15° per domain: M15 is M0 rotated.
    m0, m15 = parts[0], parts[1]
    np.testing.assert_allclose(m15.train.x, ccw(m0.train.x, 15), atol=1e-6)
    np.testing.assert_allclose(m15.test.x, ccw(m0.test.x, 15), atol=1e-6)  # the same validation digits
    # The target (M30) holds all 1000 base digits: M0's train and validation images, rotated by 30°.
    both = np.concatenate([m0.train.x, m0.test.x])
    rotated = {a.tobytes() for a in ccw(both, 30).astype(np.float32)}
    assert {a.tobytes() for a in target.x} == rotated
    # No validation digit is trained on in its own domain.
    assert not {a.tobytes() for a in m0.test.x} & {a.tobytes() for a in m0.train.x}


def test_rotation_is_counter_clockwise() -> None:
    d = load_client_data(cfg(target_domain=0, client_index=4))  # M75
    assert d.domain == 5
    img = np.zeros((1, 1, 5, 5))
    img[0, 0, 2, 4] = 1.0  # right of centre
    np.testing.assert_allclose(rotate_clockwise(img, -90)[0, 0, 0, 2], 1.0)  # counter-clockwise: to the top


def test_split_depends_on_the_seed_only() -> None:
    a, b = load_client_data(cfg(client_index=1)), load_client_data(cfg(client_index=1))
    np.testing.assert_array_equal(a.train.x, b.train.x)
    c = load_client_data(cfg(client_index=1, seed=1))
    assert not np.array_equal(a.train.x, c.train.x)


def test_fewer_organizations_make_fewer_domains() -> None:
    d = load_client_data(cfg(num_clients=2, target_domain=1, client_index=1))
    assert d.domain == 2 and "M30" in d.name and "target M15" in d.name


@pytest.mark.parametrize(("kw", "match"), [
    ({"target_domain": 6}, r"data\.target_domain must be <= data\.num_clients \(5\)"),
    ({"target_domain": -1}, r"data\.target_domain must be >= 0"),
    ({"partition": "dirichlet", "target_domain": 1}, r"target_domain is only used with partition 'rotated_lodo'"),
    ({"dataset": "digits"}, r"partition 'rotated_lodo' is not available for dataset 'digits'"),
])
def test_bad_configs_are_refused(kw: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        cfg(**kw)


def test_snapshots_embed_the_probe_set(tmp_path: Path) -> None:
    import json

    from hetfed.client.artifacts import read_snapshot, write_snapshot
    from hetfed.client.models import build_model

    data = load_client_data(cfg(target_domain=5))
    model = build_model("mlp", data.input_shape, data.num_classes, latent_dim=3)
    write_snapshot(tmp_path, "final", model, data, "mlp")
    _, z, y = read_snapshot(tmp_path / "final.npz")
    assert z.shape == (1000, 3)
    np.testing.assert_array_equal(y, data.extra_eval[TARGET_SET].y)
    assert json.loads((tmp_path / "meta.json").read_text())["probe"] == TARGET_SET


# data.rotation = "nearest": PIL's nearest-neighbour rotate, DIRT's loader (mnist_loader.py:62-74).

def test_nearest_rotation_by_hand() -> None:
    from hetfed.client.data.rotated import rotate_nearest

    img = np.arange(1, 10, dtype=np.uint8).reshape(1, 1, 3, 3)
    # 45° counter-clockwise: output pixel (y, x) takes the source pixel at its centre offset turned back
    # clockwise, floor(offset + 1.5): the ring of eight moves one place counter-clockwise, the centre stays.
    np.testing.assert_array_equal(rotate_nearest(img, 45)[0, 0], [[2, 3, 6], [1, 5, 9], [4, 7, 8]])
    np.testing.assert_array_equal(rotate_nearest(img, 90)[0, 0], [[3, 6, 9], [2, 5, 8], [1, 4, 7]])
    np.testing.assert_array_equal(rotate_nearest(img, 0), img)
    dot = np.zeros((1, 1, 5, 5), dtype=np.uint8)
    dot[0, 0, 2, 4] = 200  # right of centre
    assert np.argwhere(rotate_nearest(dot, 90)[0, 0]).tolist() == [[0, 2]]  # counter-clockwise: to the top
    with pytest.raises(ValueError, match="needs uint8 images"):
        rotate_nearest(img.astype(np.float64), 15)


def test_nearest_rotation_is_pils_per_channel() -> None:
    from PIL import Image

    from hetfed.client.data.rotated import rotate_nearest

    x = np.random.default_rng(0).integers(0, 256, (2, 3, 7, 6), dtype=np.uint8)
    out = rotate_nearest(x, 15)
    assert out.dtype == np.uint8 and out.shape == x.shape
    for i in range(2):
        for c in range(3):
            ref = Image.fromarray(x[i, c], mode="L").rotate(15, resample=Image.Resampling.NEAREST)
            np.testing.assert_array_equal(out[i, c], np.asarray(ref))


@pytest.mark.parametrize("side", [4, 5, 28])
def test_a_quarter_turn_is_exact_in_both_resamplings(side: int) -> None:
    from hetfed.client.data.rotated import rotate_stored

    pixels = np.random.default_rng(side).integers(0, 256, (3, 1, side, side)).astype(np.float64)
    turned = np.rot90(pixels, 1, axes=(2, 3)).astype(np.uint8)  # numpy's rot90 is counter-clockwise
    np.testing.assert_array_equal(rotate_stored(pixels, 90, "nearest"), turned)
    np.testing.assert_array_equal(rotate_stored(pixels, 90, "bilinear"), turned)


def test_bilinear_stays_the_stored_rounding_of_rotate_clockwise() -> None:
    from hetfed.client.data.rotated import rotate_stored

    pixels = np.rint(np.random.default_rng(1).random((4, 1, 28, 28)) * 255)
    for angle in (0, 15, 30, 45, 60, 75, -20, -40):
        before = np.clip(np.rint(rotate_clockwise(pixels, -angle)), 0, 255).astype(np.uint8)
        np.testing.assert_array_equal(rotate_stored(pixels, angle, "bilinear"), before)
    with pytest.raises(ValueError, match="rotation must be 'bilinear' or 'nearest'"):
        rotate_stored(pixels, 15, "cubic")


def test_nearest_domains_are_m0_turned_by_pil() -> None:
    from hetfed.client.data.rotated import rotate_nearest

    def load(i: int, **kw: object) -> ClientData:
        return load_client_data(cfg(target_domain=5, client_index=i, **kw))  # organization i holds M(15·i)

    default, bilinear = load(1), load(1, rotation="bilinear")
    np.testing.assert_array_equal(default.train.x, bilinear.train.x)
    assert default.name == bilinear.name and "nearest" not in default.name
    m0, m15 = load(0, rotation="nearest"), load(1, rotation="nearest")
    np.testing.assert_array_equal(m0.train.x, load(0).train.x)  # M0 is not rotated
    assert not np.array_equal(m15.train.x, default.train.x)  # the cache keeps the two resamplings apart
    stored = np.rint(m0.train.x * 255).astype(np.uint8)
    np.testing.assert_array_equal(m15.train.x, rotate_nearest(stored, 15).astype(np.float32) / np.float32(255.0))
    # Nearest-neighbour never makes a new grey level: every M15 pixel is 0 or one of its M0 image's values.
    for a, b in zip(stored[:50], np.rint(m15.train.x[:50] * 255).astype(np.uint8), strict=True):
        assert set(b.ravel().tolist()) <= set(a.ravel().tolist()) | {0}
    assert "M15, nearest" in m15.name
    # The held-out M75 is rotated the same way.
    target = np.rint(m15.extra_eval[TARGET_SET].x * 255).astype(np.uint8)
    both = np.rint(np.concatenate([m0.train.x, m0.test.x]) * 255).astype(np.uint8)
    assert {a.tobytes() for a in target} == {a.tobytes() for a in rotate_nearest(both, 75)}


@pytest.mark.parametrize(("kw", "match"), [
    ({"rotation": "cubic"}, r"data\.rotation must be one of 'bilinear', 'nearest', got 'cubic'"),
    ({"partition": "dirichlet", "rotation": "nearest"},
     r"data\.rotation applies to partition 'rotated' or 'rotated_lodo' only, got 'nearest' with partition "
     r"'dirichlet'"),
])
def test_bad_rotations_are_refused(kw: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        cfg(**kw)
