"""Diagnostics: the latent client-discriminator (chance when organizations' latents match, perfect when they are
apart) and the majority-class baseline."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from hetfed.client.diagnostics import DIAGNOSTICS, discriminator_accuracy, majority_class


def test_discriminator_is_near_chance_for_aligned_latents() -> None:
    rng = np.random.default_rng(0)
    aligned = [rng.random((400, 4)) for _ in range(4)]  # the same distribution at every organization
    assert discriminator_accuracy(aligned, seed=1) < 0.25 + 0.08


def test_discriminator_separates_shifted_latents() -> None:
    rng = np.random.default_rng(0)
    apart = [rng.random((400, 4)) + 2.0 * i for i in range(4)]
    assert discriminator_accuracy(apart, seed=1) == 1.0


def test_discriminator_is_deterministic() -> None:
    rng = np.random.default_rng(3)
    latents = [rng.normal(size=(100, 3)) + 0.3 * i for i in range(3)]
    assert discriminator_accuracy(latents, seed=5) == discriminator_accuracy(latents, seed=5)


def test_majority_class_is_each_organizations_own_most_frequent_label_on_its_test_set(tmp_path: Path) -> None:
    # Two organizations with their own files: org-0 trains mostly on class 0 and its test set holds one 0 in 4;
    # org-1 trains only on class 2 and its test set holds two 2s in 4. Uniform mean: (0.25 + 0.5) / 2.
    labels = {0: ([0, 0, 1], [0, 1, 1, 1]), 1: ([2, 2, 2], [2, 2, 0, 1])}
    for i, (train, test) in labels.items():
        root = tmp_path / f"data-{i}"
        root.mkdir()
        for name, y in (("train", train), ("test", test)):
            np.savez(root / f"{name}.npz", x=np.zeros((len(y), 3), np.float32), y=np.array(y, np.int64))
        data = {"dataset": "npz", "partition": "natural", "num_clients": 2, "client_index": i, "path": str(root)}
        (tmp_path / f"client-r-org-{i}.json").write_text(json.dumps({"data": data}))
    (tmp_path / "client-other-org-0.json").write_text("{}")  # another run's config is not read
    assert majority_class(tmp_path, {"run": "r"}, seed=0) == 0.375
    assert DIAGNOSTICS["majority_class"] is majority_class
    with pytest.raises(FileNotFoundError, match="no client configs of run 'x'"):
        majority_class(tmp_path, {"run": "x"}, seed=0)
