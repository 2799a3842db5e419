"""The close's fold by ranges: a range of elements gives the bits the whole tensor gives (exact sum, trimmed mean,
median, server-norm clip), the engine's fold from the mapped log gives the bits of a fold from memory over a run
and after a restart, and the log's pages are given back to the kernel while anonymous memory is left alone."""

from __future__ import annotations

import dataclasses
import mmap
from pathlib import Path

import numpy as np
import pytest

from hetfed.aggregator.algorithms import fedavg as fedavg_half
from hetfed.aggregator.algorithms import make_server_half
from hetfed.aggregator.algorithms.aggregators import (
    CoordinateMedian,
    ExactSum,
    Term,
    TrimmedMean,
    WeightedMean,
    clip_to_ball,
    distance,
    drop_pages,
    fold_ranges,
)
from hetfed.aggregator.algorithms.base import RunInfo
from hetfed.aggregator.config import aggregator_config_from_mapping
from hetfed.aggregator.run.admission import Limits
from hetfed.aggregator.run.conductor import Run
from hetfed.wire import digest as content
from hetfed.wire import messages
from hetfed.wire.contract import DeclaredTensor
from hetfed.wire.payloads import EvalMetrics, ModelWeights, PayloadKind, Received
from hetfed.wire.phases import Phase
from hetfed.wire.specs import SPECS
from hetfed.wire.traffic import TrafficBreakdown
from tests.conftest import run_config

SHAPES = {"enc.w": (37, 29), "enc.b": (29,), "head.w": (3, 29)}
ORGS = ("a", "b", "c", "d", "e")


def scaled(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Float32 values over nine decades: sums in other orders or splits would round differently."""
    return (rng.standard_normal(shape) * 10.0 ** rng.integers(-6, 4, shape)).astype(np.float32)


def models(seed: int, n: int = len(ORGS)) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{k: scaled(rng, s) for k, s in SHAPES.items()} for _ in range(n)]


@pytest.mark.parametrize("split", [997, ExactSum.BLOCK + 3])
def test_an_exact_sum_split_into_element_ranges_gives_the_bits_of_the_whole(split: int) -> None:
    rng = np.random.default_rng(5)
    terms = [scaled(rng, (2 * ExactSum.BLOCK + 11,)) for _ in range(6)]
    terms[2][5] = np.float32(3e38)  # one term raises its element's window after the others were added
    whole = ExactSum(terms[0].shape)
    for i, t in enumerate(terms):
        whole.add(t, 1.0 + i / 7)
    expected = whole.total()
    got = np.empty_like(expected)
    for lo in range(0, got.size, split):
        part = ExactSum((min(split, got.size - lo),))
        for i, t in enumerate(terms):
            part.add(t[lo:lo + split], 1.0 + i / 7)
        part.total(got[lo:lo + split])
    assert got.tobytes() == expected.tobytes()


def whole_model(kind: str, arrays: list[dict[str, np.ndarray]], weights: list[float]) -> dict[str, np.ndarray]:
    """The aggregate as one aggregator over whole tensors computes it."""
    acc = {"mean": WeightedMean(), "trimmed": TrimmedMean(2), "median": CoordinateMedian()}[kind]
    for a, w in zip(arrays, weights, strict=True):
        acc.add(a, w)
    return acc.mean(np.float32)


@pytest.mark.parametrize("kind", ["mean", "trimmed", "median"])
@pytest.mark.parametrize("range_elements", [1, 7, 100, 1 << 20])
@pytest.mark.parametrize("clipped", [False, True])
def test_a_fold_by_ranges_gives_the_bits_of_a_fold_of_whole_tensors(kind: str, range_elements: int,
                                                                    clipped: bool) -> None:
    arrays = models(11)
    weights = [float(w) for w in np.random.default_rng(12).integers(1, 300, len(arrays))]
    centre = models(13, 1)[0] if clipped else None
    terms = []
    moved = []
    for a, w in zip(arrays, weights, strict=True):
        clip = None
        if centre is not None:
            radius = 0.6 * distance(a, centre)  # every term is outside: each is moved onto the ball
            moved.append(clip_to_ball(a, centre, radius)[0])
            clip = radius / distance(a, centre)
        terms.append(Term(a, w, clip))
    make = {"mean": WeightedMean, "trimmed": lambda: TrimmedMean(2), "median": CoordinateMedian}[kind]
    got = fold_ranges(make, terms, centre, np.float32, range_elements)  # type: ignore[arg-type]
    expected = whole_model(kind, moved if clipped else arrays, weights)
    assert list(got) == list(expected)
    for name in expected:
        assert got[name].shape == expected[name].shape and got[name].dtype == np.float32
        assert got[name].tobytes() == expected[name].tobytes(), name


def test_a_tensor_some_updates_lack_is_divided_by_every_weight_as_before() -> None:
    a, b = models(3, 2)
    del b["head.w"]
    got = fold_ranges(WeightedMean, [Term(a, 2.0), Term(b, 3.0)], None, np.float32, 5)
    expected = whole_model("mean", [a, b], [2.0, 3.0])
    assert all(got[k].tobytes() == expected[k].tobytes() for k in expected)


@pytest.mark.parametrize("running_bytes", [0, 64 << 20])
def test_fedavgs_state_after_a_close_is_the_whole_model_fold(running_bytes: int,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fedavg_half, "RUNNING_SUM_BYTES", running_bytes)  # 0: by ranges at the close
    spec = SPECS["fedavg"]
    for config in (spec.config(), dataclasses.replace(spec.config(), aggregation="median", max_update_norm_ratio=0),
                   dataclasses.replace(spec.config(), update_norm_policy="clip", max_update_norm_ratio=0.5)):
        half = make_server_half(spec, config, RunInfo(seed=1, organizations=ORGS))
        assert half.keeps_updates
        reference: dict[str, np.ndarray] | None = None
        for round_ in (1, 2):
            arrays = models(round_)
            for org, a in zip(ORGS, arrays, strict=True):
                half.accumulate(Phase.TRAIN, org, Received([ModelWeights(a, 10 + len(org))]))
            if reference is not None and config.update_norm_policy == "clip":
                radius = config.max_update_norm_ratio * distance(reference, {})
                arrays = [clip_to_ball(a, reference, radius)[0] for a in arrays]
            kind = "median" if config.aggregation == "median" else "mean"
            reference = whole_model(kind, arrays, [11.0] * len(arrays))
            half.close_round(Phase.TRAIN, round_)
            assert all(half.state()[k].tobytes() == reference[k].tobytes() for k in reference)


def rss_file_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssFile:"):
            return int(line.split()[1])
    raise AssertionError("no RssFile in /proc/self/status")


def test_dropping_pages_gives_a_read_only_mapping_back_and_leaves_anonymous_memory_alone(tmp_path: Path) -> None:
    path = tmp_path / "blob"
    values = np.random.default_rng(4).standard_normal(16 << 20 >> 2).astype(np.float32)  # 16 MiB
    path.write_bytes(b"x" * 7 + values.tobytes())
    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    view = np.frombuffer(memoryview(mapping)[7:], np.float32)
    before = rss_file_kb()
    assert float(view.sum(dtype=np.float64)) == float(values.sum(dtype=np.float64))  # every page read in
    assert rss_file_kb() - before > 15 << 10
    drop_pages(view)
    assert rss_file_kb() - before < 1 << 10  # at most the partial pages at either end stay
    assert view.tobytes() == values.tobytes()  # the bytes come back from the file
    anonymous = values.copy()
    drop_pages(anonymous)  # MADV_DONTNEED would zero these: it is not applied
    assert anonymous.tobytes() == values.tobytes()


def engine_run(tmp_path: Path, **overrides: object) -> Run:
    cfg = aggregator_config_from_mapping({
        "server": {"listen": "127.0.0.1:0", "metrics_port": -1, "state_dir": str(tmp_path)},
        "runs": [run_config(organizations=list(ORGS), rounds=4, **overrides)]})
    s = cfg.server
    return Run(cfg.runs[0], s.state_dir, _Quiet(), Limits(s.chunk_bytes, s.max_update_bytes, s.max_tensor_elements))


class _Quiet:
    def __getattr__(self, name: str) -> object:
        return lambda *a, **k: None


def push(run: Run, org: str, round_: int, arrays: dict[str, np.ndarray]) -> None:
    data = messages.encode_update(messages.Update("r", round_, org, [
        ModelWeights(arrays, 10 + ORGS.index(org)),
        EvalMetrics(train_loss=0.5, test_accuracy=0.5, num_test_examples=5)])).data
    assert run.push(org, round_, messages.ParsedUpdate(data), content.digest(data), TrafficBreakdown()).accepted


@pytest.mark.parametrize(("aggregation", "running_bytes"), [("mean", 0), ("mean", 64 << 20), ("trimmed_mean", 0)])
def test_the_engine_folds_from_the_log_the_bits_of_a_fold_from_memory_and_again_after_a_restart(
        tmp_path: Path, aggregation: str, running_bytes: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # running_bytes 0: every model is folded at the close by ranges; 64 MiB: this small one goes into a
    # running sum as its updates arrive, read from the log all the same.
    monkeypatch.setattr(fedavg_half, "RUNNING_SUM_BYTES", running_bytes)
    extra = {} if aggregation == "mean" else {"aggregation": "trimmed_mean", "trim": 1}
    run = engine_run(tmp_path, algorithm_config=extra)
    first = models(0, 1)[0]
    for org in ORGS:
        run.join(org, messages.JoinRequest("r", org, tuple(DeclaredTensor.of(PayloadKind.MODEL_WEIGHTS, k, v)
                                                            for k, v in first.items())))
    spec = SPECS["fedavg"]
    memory = make_server_half(spec, dataclasses.replace(spec.config(), **extra),  # type: ignore[arg-type]
                              RunInfo(seed=1, organizations=ORGS))
    for round_ in (1, 2):
        near = models(round_)
        base = memory.state() or first
        arrays = [{k: (base[k] + v * np.float32(1e-3)).astype(np.float32) for k, v in m.items()} for m in near]
        for org, a in zip(ORGS, arrays, strict=True):
            memory.accumulate(Phase.TRAIN, org, Received([ModelWeights({k: v.copy() for k, v in a.items()},
                                                                       10 + ORGS.index(org))]))
        memory.close_round(Phase.TRAIN, round_)
        for i, (org, a) in enumerate(zip(ORGS, arrays, strict=True)):
            if round_ == 2 and i == 3:  # a restart with three of round 2's updates in the log
                run.close()
                run = engine_run(tmp_path, algorithm_config=extra)
            push(run, org, round_, a)
        run.commit_pending()
        got = run.aggregation.half.state()
        assert list(got) == list(memory.state())
        assert all(got[k].tobytes() == memory.state()[k].tobytes() for k in got), round_
    run.close()


@pytest.mark.parametrize("kind", ["mean", "median"])
def test_a_fold_into_the_clips_own_centre_gives_the_bits_of_a_fold_into_new_arrays(kind: str) -> None:
    arrays = models(21)
    centre = models(22, 1)[0]
    terms = [Term(a, 1.0 + i, 0.25 + 0.1 * i) for i, a in enumerate(arrays)]
    make = {"mean": WeightedMean, "median": CoordinateMedian}[kind]
    fresh = fold_ranges(make, terms, centre, np.float32, 100)  # type: ignore[arg-type]
    own = {k: v.copy() for k, v in centre.items()}
    got = fold_ranges(make, terms, own, np.float32, 100, into=own)  # type: ignore[arg-type]
    assert all(got[k] is own[k] for k in own)  # written in place
    assert all(got[k].tobytes() == fresh[k].tobytes() for k in fresh)


def test_the_finiteness_check_goes_by_blocks_and_finds_values_past_the_first() -> None:
    from hetfed.wire import contract
    from hetfed.wire.errors import WireError

    w = np.zeros(contract.FINITE_BLOCK * 2 + 10, np.float32)
    contract.check_finite(PayloadKind.MODEL_WEIGHTS, ModelWeights({"w": w}, 1))
    w[contract.FINITE_BLOCK + 3] = np.nan
    w[-1] = np.inf
    with pytest.raises(WireError) as err:
        contract.check_finite(PayloadKind.MODEL_WEIGHTS, ModelWeights({"w": w}, 1))
    assert (err.value.reason, err.value.message) == ("non_finite", "model_weights.w holds 2 NaN or infinite values")
