"""A push's claim: one update of an organization on its way in at a time, given up whenever the update is refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hetfed.aggregator.config import aggregator_config_from_mapping
from hetfed.aggregator.run.admission import Limits
from hetfed.aggregator.run.conductor import Run
from hetfed.wire import digest as content
from hetfed.wire import messages
from hetfed.wire.contract import DeclaredTensor
from hetfed.wire.errors import WireError
from hetfed.wire.payloads import EvalMetrics, ModelWeights, PayloadKind
from hetfed.wire.traffic import TrafficBreakdown
from tests.conftest import run_config

W = np.arange(6, dtype=np.float32).reshape(2, 3)


class Counting:
    """An observer that counts the duplicates it is told of."""

    duplicates = 0

    def duplicate(self) -> None:
        self.duplicates += 1

    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: None


def joined_run(tmp_path: Path) -> tuple[Run, Counting]:
    cfg = aggregator_config_from_mapping({"server": {"listen": "127.0.0.1:0", "metrics_port": -1,
                                                     "state_dir": str(tmp_path)}, "runs": [run_config()]})
    s = cfg.server
    observer = Counting()
    run = Run(cfg.runs[0], s.state_dir, observer, Limits(s.chunk_bytes, s.max_update_bytes, s.max_tensor_elements))
    for org in ("a", "b"):
        run.join(org, messages.JoinRequest("r", org, (DeclaredTensor.of(PayloadKind.MODEL_WEIGHTS, "w", W),)))
    return run, observer


def push(run: Run, org: str, w: np.ndarray) -> messages.PushReply:
    data = messages.encode_update(messages.Update("r", 1, org, [ModelWeights({"w": w}, 10), EvalMetrics(train_loss=0.5, test_accuracy=0.5, num_test_examples=5)])).data
    return run.push(org, 1, messages.ParsedUpdate(data), content.digest(data), TrafficBreakdown())


def test_a_second_update_of_an_organization_on_its_way_in_is_refused_until_the_first_settles(tmp_path: Path) -> None:
    run, _ = joined_run(tmp_path)
    run.intake.claim_locked("a", 1, None)  # a's first update is being checked or made durable
    with pytest.raises(WireError) as err:
        push(run, "a", W)
    assert (err.value.reason, err.value.retryable) == ("too_many_streams", True)
    assert "is being received" in err.value.message
    run.journal.settle_locked("a")
    assert push(run, "a", W) == messages.PushReply(accepted=True, duplicate=False, round=1)
    run.close()


def test_a_refused_update_gives_its_claim_up_and_the_next_one_is_accepted(tmp_path: Path) -> None:
    run, observer = joined_run(tmp_path)
    with pytest.raises(WireError) as err:
        push(run, "a", np.zeros((3, 2), dtype=np.float32))  # not the declared (2, 3)
    assert err.value.reason == "shape_mismatch"
    assert push(run, "a", W) == messages.PushReply(accepted=True, duplicate=False, round=1)
    assert push(run, "a", W) == messages.PushReply(accepted=True, duplicate=True, round=1)
    assert (observer.duplicates, sorted(run.pushed), run.round) == (1, ["a"], 1)
    run.close()
