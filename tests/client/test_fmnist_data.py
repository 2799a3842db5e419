"""The Fashion-MNIST loader on tiny idx files written here: magic numbers, shapes, truncation, the install hint."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest

from hetfed.client.data import DataConfig, DatasetUnavailableError, fmnist, load_client_data
from hetfed.client.data.fmnist import IMAGES_MAGIC, LABELS_MAGIC, read_idx, read_split


def _idx(magic: int, array: np.ndarray) -> bytes:
    header = magic.to_bytes(4, "big") + b"".join(int(s).to_bytes(4, "big") for s in array.shape)
    return header + array.astype(np.uint8).tobytes()


def write_split(directory: Path, split: str, n: int, seed: int, *, gz: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """n random 28×28 images with labels 0..9 cycling, as the package ships them (gzipped or raw)."""
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
    labels = (np.arange(n) % 10).astype(np.uint8)
    for kind, magic, array in (("images-idx3", IMAGES_MAGIC, images), ("labels-idx1", LABELS_MAGIC, labels)):
        data = _idx(magic, array)
        name = directory / f"{split}-{kind}-ubyte"
        if gz:
            with gzip.open(f"{name}.gz", "wb") as f:
                f.write(data)
        else:
            name.write_bytes(data)
    return images, labels


@pytest.fixture
def tiny(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    write_split(tmp_path, "train", 400, 1)
    write_split(tmp_path, "t10k", 200, 2)
    monkeypatch.setenv(fmnist.DIR_ENV, str(tmp_path))
    fmnist.load_fashion_mnist.cache_clear()
    return tmp_path


def test_reads_gzipped_and_raw_files_with_their_shapes(tmp_path: Path) -> None:
    images, labels = write_split(tmp_path, "train", 30, 0, gz=True)
    x, y = read_split(tmp_path, "train")
    assert x.shape == (30, 28, 28) and x.dtype == np.uint8 and np.array_equal(x, images)
    assert y.dtype == np.int64 and y.tolist() == labels.tolist()
    raw = tmp_path / "raw"
    raw.mkdir()
    images, _ = write_split(raw, "t10k", 12, 3, gz=False)
    assert np.array_equal(read_split(raw, "t10k")[0], images)


def test_wrong_magic_number_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "train-labels-idx1-ubyte"
    path.write_bytes(_idx(IMAGES_MAGIC, np.zeros((3, 28, 28))))  # an images file where labels belong
    with pytest.raises(DatasetUnavailableError, match=r"magic number 0x00000803, expected 0x00000801"):
        read_idx(path, LABELS_MAGIC)


def test_truncated_file_is_refused_with_a_clear_message(tmp_path: Path) -> None:
    data = _idx(IMAGES_MAGIC, np.zeros((5, 28, 28)))
    path = tmp_path / "train-images-idx3-ubyte"
    path.write_bytes(data[:-100])
    with pytest.raises(DatasetUnavailableError, match=r"truncated: 3836 bytes, the header \[5, 28, 28\] needs 3936"):
        read_idx(path, IMAGES_MAGIC)
    gz = tmp_path / "t10k-images-idx3-ubyte.gz"
    gz.write_bytes(gzip.compress(data)[:-20])  # a download cut short: the gzip stream ends early
    with pytest.raises(DatasetUnavailableError, match="truncated or corrupt gzip file"):
        read_idx(gz, IMAGES_MAGIC)


def test_shapes_and_counts_are_checked_between_files(tmp_path: Path) -> None:
    write_split(tmp_path, "train", 10, 0, gz=False)
    (tmp_path / "train-labels-idx1-ubyte").write_bytes(_idx(LABELS_MAGIC, np.zeros(9)))
    with pytest.raises(DatasetUnavailableError, match="9 labels for the 10 images"):
        read_split(tmp_path, "train")
    (tmp_path / "train-images-idx3-ubyte").write_bytes(_idx(IMAGES_MAGIC, np.zeros((9, 32, 32))))
    with pytest.raises(DatasetUnavailableError, match=r"images of \[32, 32\], expected \[28, 28\]"):
        read_split(tmp_path, "train")


def test_missing_package_says_how_to_install_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(fmnist.DIR_ENV, str(tmp_path / "absent"))
    with pytest.raises(DatasetUnavailableError) as err:
        fmnist.check_available()
    message = str(err.value)
    assert "\n" not in message and message.endswith("install it with: apt-get install dataset-fashion-mnist")


def test_partition_is_reproducible_from_the_seed(tiny: Path) -> None:
    def share(seed: int, i: int) -> tuple[np.ndarray, np.ndarray]:
        cfg = DataConfig(dataset="fmnist", partition="dirichlet", alpha=0.1, num_clients=4, client_index=i,
                         seed=seed, test_split="fedgen")
        data = load_client_data(cfg)
        return data.train.x, data.train.y

    first = [share(0, i) for i in range(4)]
    again = [share(0, i) for i in range(4)]
    for (x1, y1), (x2, y2) in zip(first, again, strict=True):
        assert np.array_equal(x1, x2) and np.array_equal(y1, y2)
    assert sum(len(y) for _, y in first) == 400  # the shares cover the training file
    other = [share(1, i) for i in range(4)]
    assert any(not np.array_equal(a[1], b[1]) for a, b in zip(first, other, strict=True))


def test_client_data_has_images_in_unit_range_and_a_balanced_global_test(tiny: Path) -> None:
    data = load_client_data(DataConfig(dataset="fmnist", partition="iid", num_clients=2, client_index=1))
    assert data.input_shape == (1, 28, 28) and data.num_classes == 10
    assert data.train.x.dtype == np.float32 and data.train.x.min() >= 0.0 and data.train.x.max() <= 1.0
    assert len(data.train) == 200 and len(data.test) == 100
    assert data.global_test is not None
    assert np.bincount(data.global_test.y, minlength=10).tolist() == [20] * 10  # the tiny test file: 20 per class


def test_hetfed_run_refuses_fmnist_without_the_package_in_one_line(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from hetfed.cli.localrun import LocalRunOptions, plan
    from hetfed.wire.config import ConfigError

    monkeypatch.setenv(fmnist.DIR_ENV, str(tmp_path / "absent"))
    with pytest.raises(ConfigError, match=r"install it with: apt-get install dataset-fashion-mnist$"):
        plan(LocalRunOptions(algorithms=("local",), dataset="fmnist"))
    plan(LocalRunOptions(algorithms=("local",)))  # the default dataset never needs it


def test_train_size_draws_a_class_balanced_subsample_from_the_data_seed(tiny: Path) -> None:
    """100 of the 400 training images (40 a class) keep 10 a class, the same images for every organization."""
    def shares(seed: int) -> list[np.ndarray]:
        return [load_client_data(DataConfig(dataset="fmnist", partition="iid", num_clients=4, client_index=i,
                                            seed=seed, train_size=100)).train.x for i in range(4)]

    first = shares(0)
    assert [len(x) for x in first] == [25] * 4
    ys = np.concatenate([load_client_data(DataConfig(dataset="fmnist", partition="iid", num_clients=4, client_index=i,
                                                     seed=0, train_size=100)).train.y for i in range(4)])
    assert np.bincount(ys, minlength=10).tolist() == [10] * 10
    rows = {r.tobytes() for r in np.concatenate(first).reshape(100, -1)}
    assert len(rows) == 100  # no image twice across organizations
    assert all(np.array_equal(a, b) for a, b in zip(first, shares(0), strict=True))
    assert any(not np.array_equal(a, b) for a, b in zip(first, shares(1), strict=True))
    with pytest.raises(ValueError, match=r"data.train_size=401 is more than the 400 training images of 'fmnist'"):
        load_client_data(DataConfig(dataset="fmnist", partition="iid", num_clients=4, train_size=401))
