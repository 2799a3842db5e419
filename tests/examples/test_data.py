"""The example's data: the image tree writer (from idx files) and the data factory over such a tree."""

from __future__ import annotations

import gzip
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hetfed_example import data
from hetfed_example.write_folder import main as write_folder_main
from PIL import Image

from hetfed.client.data import DataConfig, SeedSet
from hetfed.client.data.factory import load_factory
from tests.examples.conftest import example_env

CLASSES = ("0-a", "1-b", "2-c", "3-d")
TRAIN_PER_CLASS, TEST_PER_CLASS = 15, 12


def _write_tree(root: Path) -> Path:
    """A tiny tree: 4 classes, 15 training and 12 test PNGs each (8x8 grey; class c's pixels lie near 60c)."""
    rng = np.random.default_rng(0)
    for split, n in (("train", TRAIN_PER_CLASS), ("test", TEST_PER_CLASS)):
        for c, name in enumerate(CLASSES):
            (root / split / name).mkdir(parents=True)
            for k in range(n):
                pixels = (60 * c + rng.integers(0, 20, size=(8, 8))).astype(np.uint8)
                Image.fromarray(pixels).save(root / split / name / f"{k:03d}.png")
    return root


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_tree(tmp_path_factory.mktemp("tree"))


def _context(path: Path, index: int, clients: int, **options: str) -> SimpleNamespace:
    return SimpleNamespace(path=str(path), client_index=index, num_clients=clients, seed=7, options=options)


def _all(path: Path, clients: int, **options: str) -> list[dict]:
    return [data.fashion_folder(_context(path, i, clients, **options)) for i in range(clients)]


def test_the_training_files_are_dealt_out_disjoint_and_covering(tree: Path) -> None:
    orgs = _all(tree, 3, min_per_client="3")
    files = [f for o in orgs for f in o["train"].files]
    assert len(files) == len(set(files)) == len(CLASSES) * TRAIN_PER_CLASS
    assert set(files) == {str(p) for p in (tree / "train").rglob("*.png")}
    tests = [f for o in orgs for f in o["test"].files]
    assert len(tests) == len(set(tests))


def test_labels_match_the_class_directories_and_lie_in_range(tree: Path) -> None:
    for org in _all(tree, 3, min_per_client="3"):
        assert org["num_classes"] == len(CLASSES)
        for ds in (org["train"], org["test"]):
            assert ds.targets.dtype == np.int64 and len(ds.targets) == len(ds)
            assert set(ds.targets) <= set(range(len(CLASSES)))
            for f, y in zip(ds.files, ds.targets, strict=True):
                assert Path(f).parent.name == CLASSES[y]


def test_an_example_is_the_png_as_a_float_tensor_in_the_unit_interval(tree: Path) -> None:
    org = data.fashion_folder(_context(tree, 0, 1))
    x, y = org["train"][3]
    assert x.dtype == torch.float32 and x.shape == (1, 8, 8) and isinstance(y, int)
    with Image.open(org["train"].files[3]) as im:
        expected = np.asarray(im, dtype=np.float32) / 255.0
    np.testing.assert_array_equal(x[0].numpy(), expected)
    assert float(x.min()) >= 0.0 and float(x.max()) <= 1.0


def test_the_split_is_seeded_and_skewed_by_alpha(tree: Path) -> None:
    first = _all(tree, 3, min_per_client="3")
    second = _all(tree, 3, min_per_client="3")
    assert [o["train"].files for o in first] == [o["train"].files for o in second]
    other_seed = data.fashion_folder(SimpleNamespace(**{**vars(_context(tree, 0, 3, min_per_client="3")), "seed": 8}))
    assert other_seed["train"].files != first[0]["train"].files

    def spread(alpha: str) -> float:  # how far the organizations' label mixes are from the overall one
        orgs = _all(tree, 2, alpha=alpha, min_per_client="5", public_per_class="1")
        mixes = [np.bincount(o["train"].targets, minlength=len(CLASSES)) / len(o["train"]) for o in orgs]
        return float(np.mean([np.abs(m - 1 / len(CLASSES)).sum() for m in mixes]))

    assert spread("0.1") > spread("1000")


def test_an_organizations_test_set_follows_its_label_mix(tree: Path) -> None:
    for org in _all(tree, 2, alpha="0.3", min_per_client="3"):
        held = set(org["train"].targets.tolist())
        assert set(org["test"].targets.tolist()) <= held


def test_the_seed_set_is_the_same_in_every_organization_and_grouped_by_domain(tree: Path) -> None:
    orgs = _all(tree, 3, public_per_class="3", min_per_client="3")
    seed_sets = [o["seed_set"] for o in orgs]
    assert all(isinstance(s, SeedSet) for s in seed_sets)
    assert len({(s.id, s.sha256) for s in seed_sets}) == 1
    public = seed_sets[0]
    assert public.x.dtype == np.uint8 and public.x.shape == (3 * len(CLASSES), 1, 8, 8)
    assert public.ranges() == {0: (0, 4), 1: (4, 8), 2: (8, 12)}
    for d in range(3):  # every part holds one image of every class
        assert sorted(public.y[public.part(d)].tolist()) == list(range(len(CLASSES)))
    assert [o["domain"] for o in orgs] == [0, 1, 2]
    # The seed set's images are the first test images of each class, kept out of every test set.
    public_files = {str(tree / "test" / c / f"{k:03d}.png") for c in CLASSES for k in range(3)}
    for org in orgs:
        assert not public_files & set(org["test"].files)
    with Image.open(tree / "test" / CLASSES[0] / "000.png") as im:
        first = np.asarray(im)
    assert any(np.array_equal(public.x[j, 0], first) for j in public.part(0))


def test_hetfed_loads_the_factory_and_accepts_what_it_returns(tree: Path) -> None:
    for i in range(2):
        cfg = DataConfig(dataset="torch", partition="natural", factory="hetfed_example.data:fashion_folder",
                         path=str(tree), num_clients=2, client_index=i, seed=7,
                         options={"min_per_client": "3", "full_test": "1"})
        loaded = load_factory(cfg)
        assert loaded.num_classes == len(CLASSES) and loaded.input_shape == (1, 8, 8)
        assert loaded.domain == i and loaded.public is not None
        assert set(loaded.extra_eval) == {"full_test"}


def test_a_missing_tree_or_too_few_test_images_is_refused_in_one_line(tmp_path: Path, tree: Path) -> None:
    with pytest.raises(FileNotFoundError, match="write_folder"):
        data.fashion_folder(_context(tmp_path / "nowhere", 0, 1))
    with pytest.raises(ValueError, match="more than public_per_class=12"):
        data.fashion_folder(_context(tree, 0, 1, public_per_class="12"))
    with pytest.raises(ValueError, match="alpha"):
        data.fashion_folder(_context(tree, 0, 1, alpha="x"))


def _write_idx(directory: Path, prefix: str, images: np.ndarray, labels: np.ndarray, gz: bool) -> None:
    for kind, arr, magic in (("images-idx3", images, 0x0803), ("labels-idx1", labels, 0x0801)):
        raw = magic.to_bytes(4, "big") + b"".join(s.to_bytes(4, "big") for s in arr.shape) + arr.tobytes()
        name = directory / f"{prefix}-{kind}-ubyte"
        if gz:
            name.with_name(name.name + ".gz").write_bytes(gzip.compress(raw))
        else:
            name.write_bytes(raw)


@pytest.fixture
def idx_dir(tmp_path: Path) -> Path:
    """Fake Fashion-MNIST idx files: 20 training images (gzipped), 10 test images (raw), labels i mod 10."""
    rng = np.random.default_rng(1)
    directory = tmp_path / "idx"
    directory.mkdir()
    for prefix, n, gz in (("train", 20, True), ("t10k", 10, False)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        _write_idx(directory, prefix, images, (np.arange(n) % 10).astype(np.uint8), gz)
    return directory


def test_the_writer_turns_idx_files_into_a_tree_in_label_order(tmp_path: Path, idx_dir: Path) -> None:
    written = data.write_fashion_folder(tmp_path / "out", per_class=1, source=idx_dir)
    assert written == {"train": 10, "test": 10}
    assert sorted(p.name for p in (tmp_path / "out" / "train").iterdir()) == list(data.CLASSES)
    images = data.read_idx(idx_dir / "train-images-idx3-ubyte.gz")
    with Image.open(tmp_path / "out" / "train" / data.CLASSES[3] / "00003.png") as im:
        np.testing.assert_array_equal(np.asarray(im), images[3])
    assert data.write_fashion_folder(tmp_path / "all", source=idx_dir) == {"train": 20, "test": 10}


def test_the_writer_names_the_debian_package_when_the_files_are_missing(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist"):
        data.write_fashion_folder(tmp_path / "out", source=tmp_path)
    assert write_folder_main([str(tmp_path / "out"), "--source", str(tmp_path)]) == 1


def test_the_command_line_writes_the_tree(tmp_path: Path, idx_dir: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "hetfed_example.write_folder", str(tmp_path / "out"),
                           "--per-class", "2", "--source", str(idx_dir)],
                          capture_output=True, text=True, timeout=120, env=example_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "wrote 20 training and 10 test images" in proc.stdout
    assert len(list((tmp_path / "out" / "test").rglob("*.png"))) == 10
