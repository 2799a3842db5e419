"""The LoRA example: a frozen "pretrained" backbone with adapters, whose FedAvg moves only the adapters and the head.

The builders in process (what trains, the pretrained weights fixed whatever the run's seed, the adapters starting
at zero), then ``hetfed run`` end to end: real aggregator and client processes over loopback gRPC, and every
round's counted ModelWeights bytes, both ways, exactly those of the trainable tensors.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hetfed_example import lora

from hetfed.client.algorithms.fedavg import model_weights, shared_state
from hetfed.client.models import ModelBuilderError, build_model
from hetfed.wire import codec
from hetfed.wire.traffic import embedded_size
from tests.examples.conftest import example_env

LORA, FULL = "hetfed_example.lora:lora_cnn", "hetfed_example.lora:full_cnn"
SHARED = ["encoder.9.lora_a", "encoder.9.lora_b", "encoder.11.lora_a", "encoder.11.lora_b", "head.weight", "head.bias"]


def test_only_the_adapters_and_the_head_train_and_are_shared() -> None:
    model = build_model(LORA, (1, 28, 28), 10, seed=0)
    assert [n for n, p in model.named_parameters() if p.requires_grad] == SHARED
    assert list(shared_state(model)) == SHARED
    # rank 4 on Linear(1024, 512) and Linear(512, 128), and the head Linear(128, 10)
    assert (lora.RANK, lora.FEATURES) == (4, 128)
    assert sum(v.numel() for v in shared_state(model).values()) == 4 * (1024 + 512) + 4 * (512 + 128) + 1290 == 9994
    whole = build_model(FULL, (1, 28, 28), 10, seed=0)
    assert list(shared_state(whole)) == [k for k, v in whole.state_dict().items() if v.is_floating_point()]
    assert sum(v.numel() for v in shared_state(whole).values()) == 610954


def test_the_pretrained_weights_are_the_same_whatever_the_run_seed_and_the_adapters_start_at_zero() -> None:
    a, b = build_model(LORA, (1, 28, 28), 10, seed=0), build_model(LORA, (1, 28, 28), 10, seed=1)
    whole = build_model(FULL, (1, 28, 28), 10, seed=2)
    frozen = [n for n, p in a.named_parameters() if not p.requires_grad]
    assert len(frozen) == 12
    for name in frozen:
        assert torch.equal(a.get_parameter(name), b.get_parameter(name)), name
        assert torch.equal(a.get_parameter(name), whole.get_parameter(name.replace(".base.", "."))), name
    assert not torch.equal(a.encoder[9].lora_a, b.encoder[9].lora_a)  # A: from the run's seed
    x = torch.rand(3, 1, 28, 28)
    with torch.no_grad():
        a.eval(), whole.eval()
        assert torch.equal(a.encoder(x), whole.encoder(x))  # B = 0: the encoder is the pretrained backbone


def test_a_latent_width_other_than_the_backbones_is_refused() -> None:
    with pytest.raises(ModelBuilderError, match=r"lora_cnn: the pretrained backbone's features are 128 wide, the "
                                                r"run asks for latent_dim 64"):
        build_model(LORA, (1, 28, 28), 10, seed=0, latent_dim=64)


@pytest.mark.e2e
def test_fedavg_of_the_lora_model_moves_only_the_trainable_tensors(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "hetfed.cli", "run", "--algorithm", "fedavg", "--model", LORA, "--clients", "2",
         "--rounds", "2", "--batch-size", "16", "--set", "fedavg.local_steps=5", "--no-report", "--output", str(out)],
        capture_output=True, text=True, timeout=300, env=example_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run,) = json.loads((out / "results.json").read_text())["runs"]
    size = codec.payload_to_proto(model_weights(build_model(LORA, (1, 28, 28), 10, seed=0), 0)).ByteSize()
    # Up, each organization's count of training examples rides along: 128 to 16,383 of them take a tag and two
    # varint bytes (round 3 is the final evaluation, which uploads metrics only).
    up = [r["bytes_up"].get("model_weights", 0) for r in run["rounds"]]
    down = [r["bytes_down"].get("model_weights", 0) for r in run["rounds"]]
    assert up == [2 * embedded_size(size + 3), 2 * embedded_size(size + 3), 0]
    assert down == [0, 2 * embedded_size(size), 2 * embedded_size(size)]  # round 1 starts from the run's seed
    whole = codec.payload_to_proto(model_weights(build_model(FULL, (1, 28, 28), 10, seed=0), 0)).ByteSize()
    assert (size, whole) == (40_172, 2_444_422)  # the whole model's weights: 60.8 times the bytes
