"""docs/algorithms/adding.md's worked example runs as written.

Every Python block of the page that opens with ``# <path>.py`` under proto/, services/ or clients/ is written to
that path in a temporary tree, which a fresh interpreter adds to hetfed's three algorithm packages. It then
applies the page's registry lines (the spec registered, each side's half module imported) and runs three
rounds through both halves with two organizations, checking the global head against float64 arithmetic.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "algorithms" / "adding.md"
FILE_BLOCK = re.compile(r"```python\n# ((?:proto|services|clients)/\S+\.py)\n(.*?)```", re.DOTALL)

DRIVER = r'''
import sys
from pathlib import Path

import numpy as np

root = Path(sys.argv[1])
import hetfed.aggregator.algorithms as server_side
import hetfed.wire.specs as specs

specs.__path__.append(str(root / "proto/hetfed/wire/specs"))
server_side.__path__.append(str(root / "services/hetfed/aggregator/algorithms"))
from hetfed.wire.specs import fedavgm_head, get_spec, register

register(fedavgm_head.SPEC)  # its line in REGISTERED
import hetfed.aggregator.algorithms.fedavgm_head  # its line in the server side's registered.py
from hetfed.aggregator.algorithms import RunInfo, make_server_half, server_half_type

assert "torch" not in sys.modules, "the server half pulled in torch"
import torch

import hetfed.client.algorithms as client_side

client_side.__path__.append(str(root / "clients/hetfed/client/algorithms"))
import hetfed.client.algorithms.fedavgm_head  # its line in the client side's registered.py
from hetfed.client.algorithms import ClientContext, client_half_type
from hetfed.client.data import DataConfig, load_client_data
from hetfed.wire.payloads import EvalMetrics, HeadWeights, Received
from hetfed.wire.phases import Phase

torch.set_num_threads(1)
spec = get_spec("fedavgm_head")
config = spec.parse({"server_momentum": 0.5, "batch_size": 16, "local_steps": 2, "lr": 0.05})
assert config.server_momentum == 0.5 and server_half_type(spec).__name__ == "HeadMomentumServer"
half_type = client_half_type(spec)
orgs = ("org-0", "org-1")
server = make_server_half(spec, config, RunInfo(7, orgs))
clients = {}
for i, org in enumerate(orgs):
    data = load_client_data(DataConfig(dataset="digits", partition="iid", num_clients=2, client_index=i))
    model = half_type.make_model("mlp", data.input_shape, data.num_classes, seed=7, latent_dim=None,
                                 bounded_latent=False, config=config)
    clients[org] = half_type(ClientContext(org, model, data, torch.device("cpu"), config, 7))

head = momentum = None
for round_ in (1, 2, 3):
    uploads = {}
    for org in reversed(orgs):  # arrival order differs from the sorted order the server sums in
        received = Received(server.payloads_for(Phase.TRAIN, round_, org), spec.repeated_download)
        upload = clients[org].train(round_, 100 + round_, received)
        assert {type(p) for p in upload} == {HeadWeights, EvalMetrics}
        uploads[org] = upload
        server.accumulate(Phase.TRAIN, org, Received(upload))
    server.close_round(Phase.TRAIN, round_)
    sent = [next(p for p in uploads[o] if isinstance(p, HeadWeights)) for o in orgs]
    mean = {p: (np.float64(0) + getattr(sent[0], p).astype(np.float64) + getattr(sent[1], p).astype(np.float64)) / 2
            for p in ("weight", "bias")}
    if head is None:
        head, momentum = mean, {p: 0.0 for p in mean}
    else:
        momentum = {p: 0.5 * momentum[p] + (head[p] - mean[p]) for p in mean}
        head = {p: head[p] - momentum[p] for p in mean}
    for p in ("weight", "bias"):
        assert np.array_equal(server.head[p], head[p]), (round_, p)
    if round_ == 3:  # the first step with a momentum left from round 2 moves the head off the plain mean
        assert not np.allclose(server.head["weight"], mean["weight"])
restored = make_server_half(spec, config, RunInfo(7, orgs))
restored.load_state(server.state())
assert all(np.array_equal(restored.head[p], server.head[p]) for p in ("weight", "bias"))
print("rounds=3 head_norm=%.6f" % float(np.linalg.norm(server.head["weight"])))
'''


def _blocks() -> dict[str, str]:
    return dict(FILE_BLOCK.findall(PAGE.read_text()))


def test_the_page_shows_the_three_files_of_the_example() -> None:
    assert sorted(_blocks()) == ["clients/hetfed/client/algorithms/fedavgm_head.py",
                                 "proto/hetfed/wire/specs/fedavgm_head.py",
                                 "services/hetfed/aggregator/algorithms/fedavgm_head.py"]
    for registry in ("proto/hetfed/wire/specs/__init__.py", "services/hetfed/aggregator/algorithms/registered.py",
                     "clients/hetfed/client/algorithms/registered.py"):
        assert (REPO / registry).exists() and f"`{registry}`" in PAGE.read_text(), registry


def test_the_worked_example_registers_and_runs_three_rounds_through_its_halves(tmp_path: Path) -> None:
    for path, body in _blocks().items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(body)
    env = {**os.environ, "HETFED_ALGORITHMS": ""}
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(tmp_path)], capture_output=True, text=True,
                          timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("rounds=3 head_norm="), proc.stdout
