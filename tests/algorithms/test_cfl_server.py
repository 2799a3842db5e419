"""CFL's server half: the cosine similarities and the bipartition of four updates in two clear groups against
hand-computed numbers, the paper's optimal bipartition against every bipartition, the split criterion at its
thresholds, FedAvg of updates within a cluster against float64, the wire contract, and the clusters and their
models restored from ``state()``."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from hetfed.aggregator.algorithms import make_server_half
from hetfed.aggregator.algorithms.base import RunInfo
from hetfed.aggregator.algorithms.cfl import (
    CFLServer,
    add_mean_update,
    bipartition,
    cosine_similarities,
    cross_similarity,
    gram,
)
from hetfed.wire import codec
from hetfed.wire.contract import check_download, check_update
from hetfed.wire.errors import WireError
from hetfed.wire.payloads import EvalMetrics, HeadWeights, ModelWeights, Received
from hetfed.wire.phases import Phase
from hetfed.wire.specs import get_spec

SPEC = get_spec("cfl")
ORGS = ("a", "b", "c", "d")
RUN = RunInfo(seed=1, organizations=ORGS)
# Two clear groups, {a, b} and {c, d}: |Δ| = 5 each, cos(a, b) = cos(c, d) = 24/25, cos(a, d) = 7/25,
# cos(b, c) = -7/25, cos(a, c) = cos(b, d) = 0. The mean update is (0, 3.5): norm 3.5 exactly.
UPDATES = {"a": [3.0, 4.0], "b": [4.0, 3.0], "c": [-4.0, 3.0], "d": [-3.0, 4.0]}
THETA0 = np.array([0.5, -1.0], np.float32)


def arrays(org: str) -> dict[str, np.ndarray]:
    return {"w": np.array(UPDATES[org], np.float32)}


def upload(org: str, n: int = 1) -> Received:
    return Received([ModelWeights(arrays(org), n), EvalMetrics()])


def server(**fields: object) -> CFLServer:
    half = make_server_half(SPEC, SPEC.config(**fields), RUN)
    assert isinstance(half, CFLServer)
    for org in ORGS:  # setup: every organization sends θ_0
        half.validate(Phase.SETUP, org, Received([ModelWeights({"w": THETA0.copy()}, 1)]))
        half.accumulate(Phase.SETUP, org, Received([ModelWeights({"w": THETA0.copy()}, 1)]))
    half.close_round(Phase.SETUP, 0)
    return half


def train_round(half: CFLServer, round_: int, counts: dict[str, int] | None = None,
                orgs: tuple[str, ...] = ORGS) -> None:
    for org in orgs:
        update = upload(org, (counts or {}).get(org, 1))
        half.validate(Phase.TRAIN, org, update)
        half.accumulate(Phase.TRAIN, org, update)
    half.close_round(Phase.TRAIN, round_)


def sent(half: CFLServer, org: str, round_: int = 2) -> np.ndarray:
    (mw,) = half.payloads_for(Phase.TRAIN, round_, org)
    assert isinstance(mw, ModelWeights)
    return mw.tensors["w"]


def test_the_cosine_similarities_of_two_clear_groups_are_the_hand_computed_ones() -> None:
    g = gram([arrays(o) for o in ORGS])
    assert g.tolist() == [[25, 24, 0, 7], [24, 25, -7, 0], [0, -7, 25, 24], [7, 0, 24, 25]]
    alpha = cosine_similarities(g)
    want = np.array([[25, 24, 0, 7], [24, 25, -7, 0], [0, -7, 25, 24], [7, 0, 24, 25]], np.float64) / 25
    np.testing.assert_array_equal(alpha, want)
    assert cosine_similarities(np.zeros((2, 2))).tolist() == [[0, 0], [0, 0]]  # a zero update is similar to none


@pytest.mark.parametrize("linkage", ["single", "complete"])
def test_the_bipartition_separates_the_two_groups(linkage: str) -> None:
    alpha = cosine_similarities(gram([arrays(o) for o in ORGS]))
    c1, c2 = bipartition(alpha, linkage)  # type: ignore[arg-type]
    assert (c1, c2) == ([0, 1], [2, 3])
    assert cross_similarity(alpha, c1, c2) == 7 / 25


# A chain: 0-1 (0.9) and 1-2 (0.8) are close, 2-3 (0.3) less so. Single linkage (the paper's optimal bipartition)
# cuts off 3; complete linkage (the reference code) merges 2 and 3 first and cuts 1-2, whose similarity is 0.8.
CHAIN = np.array([[1.0, 0.9, 0.2, 0.0],
                  [0.9, 1.0, 0.8, 0.05],
                  [0.2, 0.8, 1.0, 0.3],
                  [0.0, 0.05, 0.3, 1.0]])


def test_single_and_complete_linkage_differ_on_a_chain() -> None:
    assert bipartition(CHAIN, "single") == ([0, 1, 2], [3])
    assert bipartition(CHAIN, "complete") == ([0, 1], [2, 3])
    assert cross_similarity(CHAIN, [0, 1, 2], [3]) == 0.3
    assert cross_similarity(CHAIN, [0, 1], [2, 3]) == 0.8


def _best_cross(alpha: np.ndarray) -> float:
    """min over every bipartition of max_{i∈c1, j∈c2} α_ij, by enumeration."""
    m = alpha.shape[0]
    best = np.inf
    for size in range(1, m):
        for part in itertools.combinations(range(m), size):
            rest = [i for i in range(m) if i not in part]
            best = min(best, cross_similarity(alpha, part, rest))
    return float(best)


@pytest.mark.parametrize("seed", range(20))
def test_the_papers_bipartition_minimises_the_largest_cross_similarity(seed: int) -> None:
    rng = np.random.default_rng(seed)
    m = int(rng.integers(2, 8))
    x = rng.standard_normal((m, 5))
    alpha = cosine_similarities(x @ x.T)
    c1, c2 = bipartition(alpha, "single")
    assert sorted(c1 + c2) == list(range(m)) and c1 and c2 and c1[0] == 0
    assert cross_similarity(alpha, c1, c2) == _best_cross(alpha)


def test_the_mean_update_is_the_float64_weighted_mean_added_to_the_model() -> None:
    rng = np.random.default_rng(0)
    model = {"w": rng.standard_normal((3, 4)).astype(np.float32), "b": rng.standard_normal(4).astype(np.float32)}
    ups = [{k: (rng.standard_normal(v.shape) * 10.0 ** rng.integers(-6, 2, v.shape)).astype(np.float32)
            for k, v in model.items()} for _ in range(3)]
    counts = [7.0, 1.0, 30.0]
    got = add_mean_update(model, ups, counts)
    for k in model:
        want = model[k].astype(np.float64) + sum(
            (c / 38.0) * u[k].astype(np.float64) for u, c in zip(ups, counts, strict=True))
        np.testing.assert_array_equal(got[k], want.astype(np.float32))
        assert got[k].dtype == np.float32


def test_setup_takes_the_initial_model_and_round_one_sends_it_to_everyone() -> None:
    half = server()
    assert half.clusters() == [list(ORGS)]
    for org in ORGS:
        np.testing.assert_array_equal(sent(half, org, 1), THETA0)
    assert half.payloads_for(Phase.SETUP, 0, "a") == []


def test_a_split_gives_each_group_its_own_example_weighted_mean_update() -> None:
    half = server(split_from_round=1, eps1=3.6, eps2=4.9, weighting="uniform")
    counts = {"a": 1, "b": 3, "c": 2, "d": 2}
    train_round(half, 1, counts)
    assert half.clusters() == [["a", "b"], ["c", "d"]]
    assert half.cluster_of == {"a": 0, "b": 0, "c": 1, "d": 1}
    # Uniform within each new cluster: ab: θ0 + (3.5, 3.5); cd: θ0 + (-3.5, 3.5).
    assert sent(half, "a").tolist() == sent(half, "b").tolist() == [4.0, 2.5]
    assert sent(half, "c").tolist() == sent(half, "d").tolist() == [-3.0, 2.5]
    weighted = server(split_from_round=1, eps1=3.6, eps2=4.9)
    train_round(weighted, 1, counts)
    # |D_i| / |D_c| within each cluster: ab: (1·(3, 4) + 3·(4, 3)) / 4 = (3.75, 3.25); cd: (-3.5, 3.5).
    assert sent(weighted, "a").tolist() == [4.25, 2.25]
    assert sent(weighted, "d").tolist() == [-3.0, 2.5]


@pytest.mark.parametrize(("fields", "splits"), [
    ({"eps1": 3.5, "eps2": 4.9}, False),  # ‖Δθ_c‖ = 3.5 is not below ε1 = 3.5
    ({"eps1": np.nextafter(3.5, 4.0), "eps2": 4.9}, True),
    ({"eps1": 3.6, "eps2": 5.0}, False),  # max ‖Δθ_i‖ = 5 is not above ε2 = 5
    ({"eps1": 3.6, "eps2": np.nextafter(5.0, 0.0)}, True),
    # γ_max against sqrt((1 − 7/25) / 2) = 0.6.
    ({"eps1": 3.6, "eps2": 4.9, "gamma_max": 0.59}, True),
    ({"eps1": 3.6, "eps2": 4.9, "gamma_max": 0.61}, False),
    ({"eps1": 3.6, "eps2": 4.9, "min_split_size": 5}, False),
    ({"eps1": 3.6, "eps2": 4.9, "split_from_round": 2}, False),
])
def test_the_split_criterion_at_its_thresholds(fields: dict[str, float], splits: bool) -> None:
    half = server(**{"split_from_round": 1, "weighting": "uniform", **fields})
    train_round(half, 1)
    assert half.clusters() == ([["a", "b"], ["c", "d"]] if splits else [list(ORGS)])
    if not splits:  # FedAvg of the four updates: θ0 + (0, 3.5)
        assert all(sent(half, o).tolist() == [0.5, 2.5] for o in ORGS)


def test_no_split_while_a_member_of_the_cluster_has_not_pushed() -> None:
    half = server(split_from_round=1, eps1=100.0, eps2=0.0, min_split_size=2)
    train_round(half, 1, orgs=("a", "b", "c"))
    assert half.clusters() == [list(ORGS)]
    # The three that pushed are averaged: θ0 + (1, 10/3).
    want = (THETA0.astype(np.float64) + np.array([3.0 + 4.0 - 4.0, 4.0 + 3.0 + 3.0]) / 3).astype(np.float32)
    assert sent(half, "d").tolist() == want.tolist()


def test_a_split_cluster_splits_again_by_its_own_members() -> None:
    half = server(split_from_round=1, eps1=100.0, eps2=0.0, min_split_size=2, weighting="uniform")
    train_round(half, 1)
    assert half.clusters() == [["a", "b"], ["c", "d"]]
    train_round(half, 2)  # each pair splits in two: c1 keeps the index, c2 goes last
    assert half.clusters() == [["a"], ["c"], ["b"], ["d"]]
    assert sent(half, "b", 3).tolist() == [4.0 + 4.0, 2.5 + 3.0]


def test_the_clusters_and_their_models_survive_a_restart() -> None:
    half = server(split_from_round=1, eps1=3.6, eps2=4.9)
    train_round(half, 1, {"a": 1, "b": 3, "c": 2, "d": 2})
    saved = half.state()
    assert sorted(saved) == ["cluster.a", "cluster.b", "cluster.c", "cluster.d", "model.0.w", "model.1.w"]
    restarted = make_server_half(SPEC, half.config, RUN)
    assert isinstance(restarted, CFLServer)
    restarted.load_state(saved)
    assert restarted.clusters() == half.clusters() and restarted.cluster_of == half.cluster_of
    for org in ORGS:
        assert sent(restarted, org).tobytes() == sent(half, org).tobytes()
    # The next round goes on alike, its updates replayed in another order.
    for h, order in ((half, ORGS), (restarted, ORGS[::-1])):
        train_round(h, 2, orgs=order)
    for org in ORGS:
        assert sent(restarted, org, 3).tobytes() == sent(half, org, 3).tobytes()


def test_an_update_without_examples_or_with_other_tensors_is_refused() -> None:
    half = server()
    with pytest.raises(WireError) as err:
        half.validate(Phase.TRAIN, "a", upload("a", 0))
    assert err.value.reason == "invalid_value"
    with pytest.raises(WireError) as err:
        half.validate(Phase.TRAIN, "a", Received([ModelWeights({"v": np.zeros(2, np.float32)}, 3), EvalMetrics()]))
    assert err.value.reason == "invalid_value" and "tensors" in str(err.value)


def test_the_contract_refuses_what_cfl_does_not_declare() -> None:
    schema: dict = {}  # type: ignore[type-arg]
    head = codec.payload_to_proto(HeadWeights(np.zeros((2, 3), np.float32), np.zeros(2, np.float32), 4))
    weights = codec.payload_to_proto(ModelWeights({"w": np.zeros(2, np.float32)}, 4))
    metrics = codec.payload_to_proto(EvalMetrics())
    for phase, messages in ((Phase.TRAIN, [weights, metrics, head]), (Phase.SETUP, [weights, metrics])):
        with pytest.raises(WireError) as err:
            check_update(SPEC, phase, messages, schema, 10**6)
        assert err.value.reason == "payload_kind_not_allowed"
    with pytest.raises(WireError) as err:  # a training update must carry the update
        check_update(SPEC, Phase.TRAIN, [metrics], schema, 10**6)
    assert err.value.reason == "missing_payload"
    with pytest.raises(WireError) as err:  # and a client takes nothing but a model
        check_download(SPEC, [head])
    assert err.value.reason == "payload_kind_not_allowed"
    assert check_update(SPEC, Phase.SETUP, [weights], schema, 10**6).get(ModelWeights).num_examples == 4


def test_each_checked_cluster_logs_the_norms_the_criterion_compares(caplog: pytest.LogCaptureFixture) -> None:
    half = server(split_from_round=1, eps1=3.6, eps2=4.9, weighting="uniform")
    with caplog.at_level("INFO", logger="hetfed.aggregator.algorithms.cfl"):
        train_round(half, 1)
        train_round(half, 2)  # clusters of two are below min_split_size: not checked, not logged
    (line,) = [r.getMessage() for r in caplog.records]
    assert line == ("cfl round 1, cluster 0 ['a', 'b', 'c', 'd']: mean update norm 3.5 (eps1 3.6), largest update "
                    "norm 5 (eps2 4.9); largest cross similarity 0.28, split into ['a', 'b'] and ['c', 'd']")
