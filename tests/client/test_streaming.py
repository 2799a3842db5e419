"""The one training loop streams an organization's own files through a DataLoader in the seeded order."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from hetfed.client.data import ArrayDataset
from hetfed.client.data.core import StreamedDataset
from hetfed.client.models import build_model
from hetfed.client.training import (
    DeviceData,
    Objective,
    StreamData,
    epoch_batches,
    evaluate,
    fit,
    make_optimizer,
    sampled_batches,
    source_of,
)
from hetfed.wire.specs import TrainConfig

CPU = torch.device("cpu")


class Rows(Dataset):  # type: ignore[type-arg]
    """Reads one example at a time and counts the reads (a loader of files)."""

    def __init__(self, x: np.ndarray, y: np.ndarray) -> None:
        self.x, self.y, self.reads = x, y, 0

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        self.reads += 1
        return torch.from_numpy(self.x[i]), int(self.y[i])


def arrays(n: int = 37) -> ArrayDataset:
    rng = np.random.default_rng(5)
    return ArrayDataset(rng.standard_normal((n, 1, 6, 6)).astype(np.float32), rng.integers(0, 3, n))


def streamed(ds: ArrayDataset) -> StreamedDataset:
    return StreamedDataset(Rows(ds.x, ds.y), ds.y, ds.input_shape)


@pytest.mark.parametrize("workers", [0, 2])
def test_streamed_batches_equal_the_resident_ones_in_the_seeded_order(workers: int) -> None:
    ds = arrays()
    cfg = TrainConfig(local_epochs=2, batch_size=8)
    resident = list(epoch_batches(DeviceData.of(ds, CPU), cfg, np.random.default_rng(1)))
    stream = list(epoch_batches(StreamData(streamed(ds), CPU, num_workers=workers), cfg, np.random.default_rng(1)))
    assert [len(b.y) for b in resident] == [8, 8, 8, 8, 5] * 2
    assert len(stream) == len(resident)
    for a, b in zip(resident, stream, strict=True):
        assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y)
        assert b.y.dtype == torch.int64 and b.x.dtype == torch.float32


def test_a_step_budget_and_independent_draws_are_the_same_too() -> None:
    ds = arrays()
    cfg = TrainConfig(local_steps=7, batch_size=8)  # 7 steps run into a second epoch of 5 batches
    resident = list(epoch_batches(DeviceData.of(ds, CPU), cfg, np.random.default_rng(2)))
    stream = list(epoch_batches(source_of(streamed(ds), CPU), cfg, np.random.default_rng(2)))
    assert len(resident) == len(stream) == 7
    assert all(torch.equal(a.x, b.x) for a, b in zip(resident, stream, strict=True))
    drawn = [list(sampled_batches(d, 5, 4, np.random.default_rng(3))) for d in (DeviceData.of(ds, CPU),
                                                                                source_of(streamed(ds), CPU))]
    assert all(torch.equal(a.y, b.y) and torch.equal(a.x, b.x) for a, b in zip(*drawn, strict=True))


def test_training_and_evaluation_are_bit_identical_and_read_each_example_once_an_epoch() -> None:
    ds = arrays(50)
    cfg = TrainConfig(local_epochs=3, batch_size=8, lr=0.1)
    models, losses = [], []
    data = [DeviceData.of(ds, CPU), StreamData(streamed(ds), CPU)]
    for source in data:
        model = build_model("mlp", ds.input_shape, 3, latent_dim=4, seed=0)
        result = fit([Objective(model, make_optimizer(list(model.parameters()), cfg))],
                     epoch_batches(source, cfg, np.random.default_rng(9)))
        models.append(model)
        losses.append(result.loss)
    assert losses[0] == losses[1]
    for p, q in zip(models[0].state_dict().values(), models[1].state_dict().values(), strict=True):
        assert torch.equal(p, q)
    rows = data[1].ds.dataset
    assert rows.reads == 3 * 50
    assert evaluate(models[0], data[0], batch_size=16) == evaluate(models[1], data[1], batch_size=16)
    assert rows.reads == 4 * 50


def test_take_reads_only_the_rows_asked_for() -> None:
    ds = arrays()
    source = StreamData(streamed(ds), CPU)
    batch = source.take(np.array([4, 0, 9]))
    assert torch.equal(batch.x, torch.from_numpy(ds.x[[4, 0, 9]])) and batch.y.tolist() == ds.y[[4, 0, 9]].tolist()
    assert source.ds.dataset.reads == 3
    assert source.take(np.array([], dtype=np.int64)).x.shape == (0, 1, 6, 6)
    assert torch.equal(source.y, torch.from_numpy(ds.y))  # the labels are held, the inputs are not


def test_a_subset_streams_its_own_rows() -> None:
    ds = arrays()
    part = streamed(ds).subset([3, 1, 2])
    assert len(part) == 3 and part.y.tolist() == ds.y[[3, 1, 2]].tolist()
    assert torch.equal(StreamData(part, CPU).take(np.array([0])).x[0], torch.from_numpy(ds.x[3]))
    with pytest.raises(ValueError, match=r"StreamedDataset.y must have shape \(37,\)"):
        StreamedDataset(Rows(ds.x, ds.y), ds.y[:5], ds.input_shape)


@pytest.mark.parametrize("workers", [0, 2])
def test_an_empty_poisson_sample_streams_as_an_empty_batch(workers: int) -> None:
    """At q = 0.02 over 37 examples about half the Poisson samples are empty: each comes back as a batch of no
    example, of the inputs' shape, read from no file; the others equal the resident set's, and DP-SGD steps on
    them all."""
    from hetfed.client.privacy.ledger import Ledger, Release
    from hetfed.client.privacy.mechanisms import PrivateData, PrivateStep

    def private(data: DeviceData | StreamData) -> PrivateData:
        step = PrivateStep(1.0, 1.0, 0.02, 0.74, torch.Generator().manual_seed(9),
                           Ledger("run", "org", 1e-5, "rdp", 1.0, 1.0))
        return PrivateData(data, step)

    ds = arrays()
    rows = Rows(ds.x, ds.y)
    stream = private(StreamData(StreamedDataset(rows, ds.y, ds.input_shape), CPU, num_workers=workers))
    resident = list(private(DeviceData.of(ds, CPU)).poisson_batches(12))
    streamed_batches = list(stream.poisson_batches(12))
    sizes = [len(b.y) for b in streamed_batches]
    assert sizes == [len(b.y) for b in resident] and 0 in sizes and max(sizes) > 0
    for a, b in zip(resident, streamed_batches, strict=True):
        assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y) and b.private is stream.step
        assert b.x.shape[1:] == (1, 6, 6) and b.x.dtype == torch.float32 and b.y.dtype == torch.int64
    if workers == 0:
        assert rows.reads == sum(sizes)
    model = build_model("mlp", (1, 6, 6), 3, seed=0)
    result = fit([Objective(model, make_optimizer(list(model.parameters()), TrainConfig(lr=0.1)))],
                 stream.poisson_batches(12))
    assert result.steps == 12 and stream.step.ledger.pending == [Release(0.02, 1.0, 12)]
