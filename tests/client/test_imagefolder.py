"""Dataset "imagefolder": an organization's own images in a directory per class, read through Pillow."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import Subset

from hetfed.client.data import ClientData, DataConfig, DataFactoryError, StreamedDataset, load_client_data
from hetfed.client.data.imagefolder import ImageFolder, ImageFolderError

GREY = np.array([[0, 51], [102, 255]], dtype=np.uint8)


def png(path: Path, pixels: np.ndarray | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(GREY if pixels is None else pixels).save(path)
    return path


def tree(root: Path, counts: dict[str, int]) -> Path:
    """``counts[c]`` grey 2x2 PNGs under root/c/, image k of a class holding the value k everywhere."""
    for c, n in counts.items():
        for k in range(n):
            png(root / c / f"{k:03d}.png", np.full((2, 2), k, dtype=np.uint8))
    return root


def cfg(path: Path, **kwargs: object) -> DataConfig:
    kwargs.setdefault("partition", "natural")
    return DataConfig(dataset="imagefolder", path=str(path), **kwargs)  # type: ignore[arg-type]


def files_of(ds: object) -> list[str]:
    """The image files behind a (possibly subset) streamed dataset, in its order."""
    assert isinstance(ds, StreamedDataset)
    inner, idx = ds.dataset, list(range(len(ds)))
    while isinstance(inner, Subset):
        idx = [int(inner.indices[i]) for i in idx]
        inner = inner.dataset
    assert isinstance(inner, ImageFolder)
    return [inner.files[i] for i in idx]


# ---------------------------------------------------------------- listing and pixels


def test_listing_sorts_classes_and_files_and_ignores_other_files(tmp_path: Path) -> None:
    png(tmp_path / "dog" / "b.PNG")
    png(tmp_path / "dog" / "a.png")
    (tmp_path / "cat").mkdir()
    Image.new("L", (2, 2), 128).save(tmp_path / "cat" / "x.JPG", format="JPEG")
    png(tmp_path / "cat" / "deeper" / "y.jpeg")
    (tmp_path / "cat" / "notes.txt").write_text("not an image")
    png(tmp_path / "cat" / ".hidden.png")
    (tmp_path / ".cache").mkdir()
    ds = ImageFolder(tmp_path)
    assert ds.classes == ["cat", "dog"]
    assert [Path(f).relative_to(tmp_path).as_posix() for f in ds.files] == [
        "cat/x.JPG", "cat/deeper/y.jpeg", "dog/a.png", "dog/b.PNG"]
    assert ds.targets.dtype == np.int64
    np.testing.assert_array_equal(ds.targets, [0, 0, 1, 1])
    assert ds.channels == 1 and ds.input_shape == (1, 2, 2) and len(ds) == 4
    x, label = ds[0]  # the JPEG: a uniform grey survives compression
    assert x.dtype == torch.float32 and label == 0
    np.testing.assert_allclose(x.numpy(), np.full((1, 2, 2), 128 / 255), atol=1 / 255)


def test_grey_pixels_scaled_and_normalised_exactly(tmp_path: Path) -> None:
    png(tmp_path / "a" / "0.png")
    x, _ = ImageFolder(tmp_path)[0]
    np.testing.assert_array_equal(x.numpy(), (GREY / np.float32(255)).astype(np.float32)[None])
    x, _ = ImageFolder(tmp_path, mean=(0.5,), std=(0.25,))[0]
    np.testing.assert_allclose(x.numpy(), [[[-2.0, -1.2], [-0.4, 2.0]]], rtol=0, atol=1e-6)


def test_bilinear_resize_of_a_two_by_two_image(tmp_path: Path) -> None:
    png(tmp_path / "a" / "0.png", np.array([[0, 40], [80, 120]], dtype=np.uint8))
    ds = ImageFolder(tmp_path, image_size=4)
    expected = np.array([[0, 10, 30, 40], [20, 30, 50, 60], [60, 70, 90, 100], [80, 90, 110, 120]]) / 255
    assert ds.input_shape == (1, 4, 4)
    np.testing.assert_allclose(ds[0][0].numpy()[0], expected, rtol=0, atol=1e-7)


def test_rgb_channels_first_and_conversions(tmp_path: Path) -> None:
    rgb = np.array([[[255, 0, 0], [0, 255, 0]], [[0, 0, 255], [10, 20, 30]]], dtype=np.uint8)
    png(tmp_path / "a" / "0.png", rgb)
    png(tmp_path / "a" / "1.png")  # grey, read as RGB like the first image
    ds = ImageFolder(tmp_path, mean=(0.0, 0.0, 1.0), std=(1.0, 1.0, 0.5))
    assert ds.channels == 3 and ds.input_shape == (3, 2, 2)
    x = ds[0][0].numpy()
    np.testing.assert_allclose(x[0] * 255, [[255, 0], [0, 10]], atol=1e-4)
    np.testing.assert_allclose(x[1] * 255, [[0, 255], [0, 20]], atol=1e-4)
    np.testing.assert_allclose(x[2], (rgb[:, :, 2] / 255 - 1.0) / 0.5, atol=1e-6)
    grey_as_rgb = ds[1][0].numpy()
    np.testing.assert_allclose(grey_as_rgb[0], grey_as_rgb[1])
    np.testing.assert_allclose(grey_as_rgb[0] * 255, GREY, atol=1e-4)
    # Asked for one channel: Pillow's luma L = (299 R + 587 G + 114 B) / 1000.
    one = ImageFolder(tmp_path, channels=1)[0][0].numpy()
    np.testing.assert_allclose(one * 255, [[[76, 150], [29, 18]]], atol=1e-4)


def test_sixteen_bit_png_scaled_by_65535_and_resized(tmp_path: Path) -> None:
    wide = np.array([[0, 65535], [13107, 65535]], dtype=np.uint16)
    png(tmp_path / "a" / "0.png", wide)
    ds = ImageFolder(tmp_path)
    assert ds.channels == 1
    np.testing.assert_allclose(ds[0][0].numpy(), [[[0.0, 1.0], [0.2, 1.0]]], atol=1e-6)
    three = ImageFolder(tmp_path, channels=3, image_size=1)[0][0].numpy()
    assert three.shape == (3, 1, 1)
    np.testing.assert_allclose(three.ravel(), [0.55] * 3, atol=1e-5)  # downscaling averages the four pixels


# ---------------------------------------------------------------- load_imagefolder


def test_flat_layout_holds_out_a_stratified_fifth(tmp_path: Path) -> None:
    tree(tmp_path / "xray", {"normal": 10, "pneumonia": 5})
    data = load_client_data(cfg(tmp_path / "xray", seed=3))
    assert isinstance(data, ClientData) and isinstance(data.train, StreamedDataset)
    assert (data.num_classes, data.input_shape, data.name, data.global_test) == (2, (1, 2, 2), "imagefolder[xray]",
                                                                                  None)
    assert len(data.test) == 3 and len(data.train) == 12  # round(0.2 x 10) + round(0.2 x 5) held out
    assert sorted(data.test.y.tolist()) == [0, 0, 1]
    train, test = files_of(data.train), files_of(data.test)
    assert not set(train) & set(test) and len(set(train) | set(test)) == 15
    for ds in (data.train, data.test):
        for i, f in enumerate(files_of(ds)):
            assert ds.y[i] == (0 if "/normal/" in f else 1)
    assert isinstance(data.test, StreamedDataset)
    x, label = data.test.dataset[0]
    assert label == int(data.test.y[0])
    assert x.shape == (1, 2, 2) and float(x[0, 0, 0]) * 255 == pytest.approx(int(Path(files_of(data.test)[0]).stem))
    again = load_client_data(cfg(tmp_path / "xray", seed=3))
    assert files_of(again.test) == test


def test_train_and_test_directories(tmp_path: Path) -> None:
    tree(tmp_path / "train", {"a": 3, "b": 2})
    tree(tmp_path / "test", {"a": 1, "b": 2})
    data = load_client_data(cfg(tmp_path, image_size=3))
    assert (len(data.train), len(data.test), data.input_shape) == (5, 3, (1, 3, 3))
    np.testing.assert_array_equal(data.test.y, [0, 1, 1])
    assert all("/test/" in f for f in files_of(data.test))


@pytest.mark.parametrize("partition", ["iid", "dirichlet"])
def test_pooled_partitions_are_disjoint_and_cover(tmp_path: Path, partition: str) -> None:
    tree(tmp_path, {"a": 12, "b": 9, "c": 6})
    clients = [load_client_data(cfg(tmp_path, partition=partition, num_clients=3, client_index=i, min_per_client=2))
               for i in range(3)]
    pool = files_of(clients[0].global_test)
    assert len(pool) == 5  # round(0.2 x 12) + round(0.2 x 9) + round(0.2 x 6) = 2 + 2 + 1 held out
    trains = [files_of(c.train) for c in clients]
    tests = [files_of(c.test) for c in clients]
    assert sum(map(len, trains)) == 22 and len(set().union(*trains)) == 22
    assert not set().union(*trains) & set(pool)
    assert len(set().union(*tests)) == sum(map(len, tests)) and set().union(*tests) <= set(pool)
    if partition == "iid":
        assert [len(t) for t in trains] == [8, 7, 7] and [len(t) for t in tests] == [2, 2, 1]
    for c in clients:
        assert c.num_classes == 3 and files_of(c.global_test) == pool
        assert c.name.startswith(f"imagefolder[{tmp_path.name}, {partition}")


# ---------------------------------------------------------------- bad input


def test_missing_directory_and_empty_class(tmp_path: Path) -> None:
    with pytest.raises(DataFactoryError, match=r"absent: not a directory"):
        load_client_data(cfg(tmp_path / "absent"))
    (tmp_path / "empty_root").mkdir()
    with pytest.raises(ImageFolderError, match=r"empty_root: no class directories"):
        load_client_data(cfg(tmp_path / "empty_root"))
    tree(tmp_path / "t", {"a": 2})
    (tmp_path / "t" / "b").mkdir()
    (tmp_path / "t" / "b" / "readme.txt").write_text("x")
    with pytest.raises(ImageFolderError, match=r"t/b: class directory holds no images \(.png, .jpg, .jpeg\)$"):
        load_client_data(cfg(tmp_path / "t"))


def test_unreadable_image_is_named_at_load_or_when_read(tmp_path: Path) -> None:
    tree(tmp_path, {"a": 2, "b": 2})
    bad = tmp_path / "b" / "001.png"
    bad.write_bytes(b"not a png at all")
    with pytest.raises(ImageFolderError, match=rf"^{bad}: not a readable image \(UnidentifiedImageError: ") as info:
        load_client_data(cfg(tmp_path))
    assert isinstance(info.value, ValueError) and "\n" not in str(info.value)
    ds = ImageFolder(tmp_path, verify=False)  # listing alone succeeds; reading the file fails
    with pytest.raises(ImageFolderError, match=rf"^{bad}: cannot decode image \(UnidentifiedImageError: "):
        ds[3]


def test_truncated_image_fails_when_decoded(tmp_path: Path) -> None:
    tree(tmp_path, {"a": 2})
    noise = np.random.default_rng(0).integers(0, 256, (64, 64), dtype=np.uint8)  # incompressible
    big = png(tmp_path / "a" / "002.png", noise)
    big.write_bytes(big.read_bytes()[:120])
    ds = ImageFolder(tmp_path, image_size=2)  # the header is intact
    with pytest.raises(ImageFolderError, match=rf"^{big}: cannot decode image \("):
        ds[2]


def test_sizes_must_agree_without_image_size(tmp_path: Path) -> None:
    tree(tmp_path, {"a": 2})
    odd = png(tmp_path / "a" / "009.png", np.zeros((3, 2), dtype=np.uint8))
    with pytest.raises(ImageFolderError, match=rf"^{odd}: 2x3 pixels but .*000.png has 2x2; set data.image_size"):
        load_client_data(cfg(tmp_path))
    with pytest.raises(ImageFolderError, match=rf"^{odd}: read as shape \(1, 3, 2\) but .* as \(1, 2, 2\)"):
        ImageFolder(tmp_path, verify=False)[2]
    assert load_client_data(cfg(tmp_path, image_size=2, seed=1)).input_shape == (1, 2, 2)


def test_test_classes_must_equal_train_classes(tmp_path: Path) -> None:
    tree(tmp_path / "train", {"a": 2, "b": 2})
    tree(tmp_path / "test", {"a": 1, "c": 1})
    with pytest.raises(ImageFolderError, match=r"test: class directories differ from the training set's: "
                                               r"missing \['b'\], extra \['c'\]$"):
        load_client_data(cfg(tmp_path))


def test_normalisation_needs_one_value_per_channel(tmp_path: Path) -> None:
    tree(tmp_path, {"a": 2})
    with pytest.raises(ImageFolderError, match=r"data.mean and data.std need one value per channel \(1\), got 3"):
        load_client_data(cfg(tmp_path, mean=(0.5, 0.5, 0.5), std=(0.2, 0.2, 0.2)))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dataset": "imagefolder", "partition": "natural"}, r"data.path must name a directory of class directories"),
        ({"dataset": "imagefolder", "partition": "domain", "path": "/d"}, r"partition 'domain' is not available"),
        ({"image_size": 32}, r"data.image_size, channels and verify_images apply to dataset 'imagefolder' "
                             r"only, got image_size 32 for dataset 'mnist5k'$"),
        ({"channels": 1, "verify_images": False}, r"only, got channels 1, verify_images False for dataset"),
        ({"dataset": "imagefolder", "path": "/d", "image_size": -1}, r"data.image_size must be >= 0, got -1"),
        ({"dataset": "imagefolder", "path": "/d", "channels": 2}, r"data.channels must be 0 \(from the first image\), "
                                                                  r"1 or 3, got 2"),
        ({"dataset": "imagefolder", "path": "/d", "mean": (0.5,)}, r"data.mean and data.std must have the same "
                                                                   r"length, got 1 and 0"),
        ({"dataset": "imagefolder", "path": "/d", "mean": (0.5,), "std": (0.0,)}, r"data.std must be > 0, got 0"),
        ({"dataset": "imagefolder", "path": "/d", "mean": (0.1, 0.2), "std": (1.0, 1.0)},
         r"need one value per channel \(1 or 3\), got 2"),
        ({"dataset": "imagefolder", "path": "/d", "channels": 3, "mean": (0.1,), "std": (1.0,)},
         r"need one value per channel \(3\), got 1"),
        ({"dataset": "imagefolder", "path": "/d", "verify_images": 1}, r"data.verify_images must be true or false"),
    ],
)
def test_config_fields_of_imagefolder(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DataConfig(**kwargs)  # type: ignore[arg-type]
