"""Dataset "torch": an organization's own data factory, its checks and its config fields."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from hetfed.client.data import (
    DataConfig,
    DataContext,
    DataFactoryError,
    SeedSet,
    StreamedDataset,
    load_client_data,
    load_seed_set,
)
from hetfed.client.data import factory as factory_module

HERE = Path(__file__).resolve().parent


@pytest.fixture(autouse=True)
def own_data_pkg(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.syspath_prepend(str(HERE))
    import own_data_pkg

    own_data_pkg.CALLS.clear()
    factory_module._from_factory.cache_clear()
    yield
    factory_module._from_factory.cache_clear()


def cfg(factory: str = "own_data_pkg:make", **kwargs: object) -> DataConfig:
    return DataConfig(dataset="torch", partition="natural", factory=factory, **kwargs)  # type: ignore[arg-type]


def test_factory_data_is_streamed_with_its_labels_known() -> None:
    import own_data_pkg

    data = load_client_data(cfg(path="/data/site", client_index=1, num_clients=3, seed=7, options={"site": "north"}))
    (context,) = own_data_pkg.CALLS
    assert context == DataContext("/data/site", 1, 3, 7, {"site": "north"})
    assert isinstance(data.train, StreamedDataset) and isinstance(data.test, StreamedDataset)
    np.testing.assert_array_equal(data.train.y, [0, 1, 2, 0, 1, 2, 0, 1])  # from targets
    np.testing.assert_array_equal(data.test.y, [2, 1, 0, 0])  # read by iterating
    assert (data.num_classes, data.input_shape, data.name, data.domain) == (3, (1, 2, 2), "own[north]", 1)
    assert data.global_test is None and data.public is None
    assert list(data.eval_sets()) == ["night"]
    np.testing.assert_array_equal(data.eval_sets()["night"].y, [1, 1])
    x, label = data.train.dataset[3]
    assert x.dtype == torch.float32 and tuple(x.shape) == (1, 2, 2) and bool((x == 3.0).all())
    assert label == 0 and type(label) is int
    assert data.train.subset([3]).dataset[0][1] == 0


def test_a_datasets_groups_are_its_examples_group_ids() -> None:
    """A factory's dataset with a ``groups`` attribute (like ``targets``): one id per example, kept by subsets;
    a set without it has none."""
    data = load_client_data(cfg("own_data_pkg:with_groups"))
    assert isinstance(data.train, StreamedDataset) and data.train.groups is not None
    np.testing.assert_array_equal(data.train.groups, [10, 10, 10, 20, 20, 20, 30, 30])
    sub = data.train.subset([7, 0])
    assert sub.groups is not None
    np.testing.assert_array_equal(sub.groups, [30, 10])
    assert data.test.groups is None


def test_eval_set_named_global_test_is_the_global_test() -> None:
    data = load_client_data(cfg("own_data_pkg:with_global_test"))
    assert data.global_test is not None and len(data.global_test) == 2
    assert list(data.extra_eval) == ["far"] and list(data.eval_sets()) == ["global_test", "far"]


def test_data_seed_is_the_seed_the_factory_sees() -> None:
    import own_data_pkg

    load_client_data(cfg(seed=7, data_seed=11))
    assert own_data_pkg.CALLS[0].seed == 11


def test_factory_is_called_once_per_config() -> None:
    import own_data_pkg

    first = load_client_data(cfg())
    assert load_client_data(cfg()) is first
    assert load_seed_set(cfg()) is None
    assert len(own_data_pkg.CALLS) == 1
    load_client_data(cfg(options={"site": "south"}))
    assert len(own_data_pkg.CALLS) == 2


def test_labels_read_by_dataloader_workers() -> None:
    data = load_client_data(cfg(num_workers=2))
    np.testing.assert_array_equal(data.test.y, [2, 1, 0, 0])


def test_seed_set_from_the_factory_or_the_mounted_file(tmp_path: Path) -> None:
    own = load_seed_set(cfg("own_data_pkg:with_seed_set"))
    assert isinstance(own, SeedSet) and own.id == "own-seed" and len(own) == 4
    data = load_client_data(cfg("own_data_pkg:with_seed_set"))
    assert data.public is own and data.domain == 1 and data.seed_set == ("own-seed", own.sha256)
    mounted = SeedSet("mounted", np.ones((2, 1, 2, 2), dtype=np.uint8), np.array([0, 1]), np.array([0, 1]))
    mounted.save(tmp_path / "seed.npz")
    got = load_seed_set(cfg("own_data_pkg:with_seed_set", seed_set_path=str(tmp_path / "seed.npz")))
    assert got is not None and (got.id, got.sha256) == ("mounted", mounted.sha256)


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        ("no_such_module_zz:make", r"^data.factory 'no_such_module_zz:make': cannot import module 'no_such_module_zz' "
                                   r"\(ModuleNotFoundError: No module named 'no_such_module_zz'\); install it"),
        ("own_data_pkg:absent", r"^data.factory 'own_data_pkg:absent': module 'own_data_pkg' has no attribute "
                                r"'absent'$"),
        ("own_data_pkg:NOT_A_FUNCTION", r"'NOT_A_FUNCTION' is a int, not a function$"),
        ("own_data_pkg:raises", r"^data.factory 'own_data_pkg:raises' raised RuntimeError: disk /data/xray not "
                                r"mounted$"),
        ("own_data_pkg:returns_list", r"returned list, expected a mapping with keys 'train', 'test', 'num_classes'$"),
        ("own_data_pkg:lacks_test", r"returned no 'test' \(it must return 'train', 'test', 'num_classes'\)$"),
        ("own_data_pkg:misspelled", r"returned unknown key\(s\) 'tests' \(allowed: train, test, num_classes, eval, "),
        ("own_data_pkg:iterable_train", r"the train set is a Stream, not a map-style Dataset"),
        ("own_data_pkg:number_test", r"the test set is a int, not a map-style Dataset"),
        ("own_data_pkg:zero_classes", r"num_classes must be a positive integer, got 0$"),
        ("own_data_pkg:float_classes", r"num_classes must be a positive integer, got 2.0$"),
        ("own_data_pkg:labels_out_of_range", r"the test set has 4 label\(s\) outside 0..2: -1 \(1 example\), "
                                             r"3 \(2 examples\), 5 \(1 example\)$"),
        ("own_data_pkg:empty_train", r"the train set is empty$"),
        ("own_data_pkg:shapes_differ", r"the test set: example 0 has shape \(3, 2, 2\) but the train set's have "
                                       r"\(1, 2, 2\)$"),
        ("own_data_pkg:eval_shape_differs", r"the eval set 'far': example 0 has shape \(2,\) but the train set's"),
        ("own_data_pkg:eval_named_test", r"eval set name 'test' must be letters, digits and _ \(starting with a "
                                         r"letter\) and none of test, train$"),
        ("own_data_pkg:not_pairs", r"the train set: example 0 is a Tensor, expected a pair \(x, label\)$"),
        ("own_data_pkg:float_labels", r"the train set: example 0's label 0.5 is not an integer$"),
        ("own_data_pkg:seed_set_shape_differs", r"its seed_set holds examples of shape \(3,\) but the train set's "
                                                r"are \(1, 2, 2\)$"),
        ("own_data_pkg:groups_too_short", r"the train set: groups must hold one group id per example, shape \(3,\), "
                                          r"got \(2,\)$"),
        ("own_data_pkg:float_groups", r"the train set: groups must be integers, got dtype float64$"),
    ],
)
def test_bad_factories_are_one_line_errors(factory: str, message: str) -> None:
    with pytest.raises(DataFactoryError, match=message) as info:
        load_client_data(cfg(factory))
    assert isinstance(info.value, ValueError) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("import not_installed_dependency_zz\n", r"cannot import module 'broken_factory_mod' \(ModuleNotFoundError: "
                                                 r"No module named 'not_installed_dependency_zz'\)$"),
        ("def make(context:\n", r"cannot import module 'broken_factory_mod' \(SyntaxError: "),
    ],
)
def test_module_that_fails_to_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str,
                                     message: str) -> None:
    (tmp_path / "broken_factory_mod.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "broken_factory_mod", raising=False)
    with pytest.raises(DataFactoryError, match=message) as info:
        load_client_data(cfg("broken_factory_mod:make"))
    assert "\n" not in str(info.value)


def test_example_of_another_shape_fails_when_read() -> None:
    data = load_client_data(cfg("own_data_pkg:ragged"))
    assert isinstance(data.train, StreamedDataset)
    assert data.train.dataset[0][0].shape == (2,)
    with pytest.raises(DataFactoryError, match=r"the train set: example 1 has shape \(3,\) but example 0 has \(2,\)$"):
        data.train.dataset[1]


@pytest.mark.parametrize("workers", [0, 2])
def test_failure_while_reading_labels_is_one_line(workers: int) -> None:
    with pytest.raises(DataFactoryError, match=r"the train set: reading its labels raised OSError: cannot read "
                                               r"/data/2.png$") as info:
        load_client_data(cfg("own_data_pkg:faulty", num_workers=workers))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dataset": "torch", "partition": "natural"},
         r"data.factory must name the data factory as \"package.module:function\" for dataset 'torch', got ''"),
        ({"dataset": "torch", "partition": "natural", "factory": "own_data_pkg.make"}, r"got 'own_data_pkg.make'"),
        ({"factory": "own_data_pkg:make"},
         r"data.factory and data.options are only used with dataset 'torch', got factory 'own_data_pkg:make' for "
         r"dataset 'mnist5k'"),
        ({"options": {"site": "north"}}, r"only used with dataset 'torch', got options \{'site': 'north'\}"),
        ({"dataset": "torch", "partition": "natural", "factory": "m:f", "options": {"n": 3}},
         r"data.options must map names to strings"),
        ({"dataset": "torch", "partition": "natural", "factory": "m:f", "train_on_public": True},
         r"data.train_on_public is not available with dataset 'torch'"),
        ({"dataset": "torch", "partition": "dirichlet", "factory": "m:f"}, r"partition 'dirichlet' is not available"),
        ({"path": "/data"}, r"data.path is only used with dataset 'imagefolder' or 'npz' or 'torch'"),
        ({"num_workers": -1}, r"data.num_workers must be >= 0, got -1"),
        ({"pin_memory": "yes"}, r"data.pin_memory must be true or false"),
    ],
)
def test_config_fields_of_the_factory(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DataConfig(**kwargs)  # type: ignore[arg-type]


def test_config_accepts_a_path_for_the_factory() -> None:
    c = cfg(path="/data/site", options={"site": "north"}, num_workers=4, pin_memory=False)
    assert (c.path, c.options, c.num_workers) == ("/data/site", {"site": "north"}, 4)


def test_validating_a_config_imports_neither_torch_nor_the_factory() -> None:
    code = ("import sys; from hetfed.client.data import DataConfig; "
            "DataConfig(dataset='torch', partition='natural', factory='own_data_pkg:make'); "
            "import hetfed.client.data.factory; "
            "assert not {'torch', 'own_data_pkg', 'PIL'} & set(sys.modules), sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)
