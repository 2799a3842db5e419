"""Taking the trained model out: TorchScript, state_dict and card (hetfed.client.export), ``hetfed export``, and
the files reproducing the reported accuracy in an interpreter where hetfed is not importable."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry
from torch import nn

from hetfed.client.config import ClientConfig
from hetfed.client.export import (
    CARD_FILE,
    CARD_FORMAT,
    MODEL_FILE,
    NOISE_SEED,
    STATE_FILE,
    ExportError,
    accuracies,
    export_after_run,
    export_model,
    traffic_totals,
)
from hetfed.client.models import SplitModel, build_model
from hetfed.client.training import (
    DeviceData,
    Objective,
    epoch_batches,
    evaluate,
    fit,
    make_optimizer,
    trainable,
)
from hetfed.wire.payloads import EvalMetrics
from hetfed.wire.specs.fedavg import FedAvgConfig
from hetfed.wire.traffic import KindCount, TrafficBreakdown, TrafficMetrics

# TorchScript is deprecated in favour of torch.export; it is still the format that loads anywhere without hetfed.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.*is deprecated:DeprecationWarning")
SHAPE = (1, 8, 8)
TORCH_SITE = str(Path(torch.__file__).resolve().parents[1])


def _data(n: int, seed: int, signal: float = 0.6) -> tuple[torch.Tensor, torch.Tensor]:
    """A 3-class problem on 8x8 inputs: the class brightens one band of columns by ``signal`` over noise."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 3, (n,), generator=g)
    x = torch.rand((n, *SHAPE), generator=g) * 0.5
    for c in range(3):
        x[y == c, :, :, c * 2 : c * 2 + 3] += signal
    return x, y


def _files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def _fresh_python(tmp_path: Path, script: str) -> subprocess.CompletedProcess[str]:
    """Run ``script`` with ``python -S`` (no site, no .pth files: no editable hetfed), only torch's
    site-packages on the path, from a folder without hetfed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONPATH"] = TORCH_SITE
    return subprocess.run([sys.executable, "-S", "-c", textwrap.dedent(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)


# ------------------------------------------------------------------------------------------- export_model
def test_a_built_in_model_is_scripted_with_its_state_dict_and_card(tmp_path: Path) -> None:
    model = build_model("mlp", SHAPE, 3, seed=1)
    x, _ = _data(64, 0)
    card_path = export_model(tmp_path / "model", model, example_input=x, architecture="mlp", run="r1",
                             organization="org-0", algorithm="fedavg", rounds=2,
                             accuracy={"test_accuracy": 0.75, "global_test_accuracy": 0.5}, num_test_examples=40,
                             bytes_sent=1234, bytes_received=5678, dataset="toy")
    folder = tmp_path / "model"
    assert card_path == folder / CARD_FILE
    assert _files(folder) == [CARD_FILE, MODEL_FILE, STATE_FILE]  # no temporary file left behind
    card = json.loads(card_path.read_text())
    assert card["format"] == CARD_FORMAT and card["torchscript"] == "script"
    assert {k: card[k] for k in ("run", "organization", "algorithm", "rounds", "architecture", "dataset")} == {
        "run": "r1", "organization": "org-0", "algorithm": "fedavg", "rounds": 2, "architecture": "mlp",
        "dataset": "toy"}
    assert card["accuracy"] == {"test_accuracy": 0.75, "global_test_accuracy": 0.5}
    assert card["num_test_examples"] == 40 and card["bytes"] == {"sent": 1234, "received": 5678}
    assert (card["input_shape"], card["input_dtype"], card["num_classes"], card["latent_dim"]) == (
        [1, 8, 8], "float32", 3, 64)
    assert card["torch_version"] == torch.__version__
    assert card["load"].startswith("import torch; classes = torch.jit.load('model.ts')")
    for name in (MODEL_FILE, STATE_FILE):
        data = (folder / name).read_bytes()
        assert card["files"][name] == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    # The state dict is plain tensors and loads into the architecture rebuilt by name.
    state = torch.load(folder / STATE_FILE, weights_only=True)
    rebuilt = build_model("mlp", SHAPE, 3, seed=99)
    rebuilt.load_state_dict(state)
    scripted = torch.jit.load(str(folder / MODEL_FILE))
    with torch.no_grad():
        want = torch.log_softmax(model.eval()(x), dim=1)
        assert torch.equal(scripted(x), want)
        assert torch.equal(torch.log_softmax(rebuilt.eval()(x), dim=1), want)


class _Unscriptable(nn.Module):
    """An encoder TorchScript cannot compile (a variadic forward), which traces fine."""

    def __init__(self, trace_fixes_batch: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 16)
        self.trace_fixes_batch = trace_fixes_batch

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        x = inputs[0]
        # int(): right for every batch here, but a trace records the batch size it saw as a constant.
        rows = int(x.shape[0]) if self.trace_fixes_batch else x.shape[0]
        return torch.relu(self.lin(x.reshape(rows, -1)))


def test_a_model_torchscript_cannot_compile_is_traced_on_the_examples(tmp_path: Path) -> None:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = SplitModel(_Unscriptable(), 16, 3)
    x, _ = _data(64, 1)
    card = json.loads(export_model(tmp_path, model, example_input=x, architecture="pkg.mod:own").read_text())
    assert card["torchscript"] == "trace" and card["architecture"] == "pkg.mod:own"
    traced = torch.jit.load(str(tmp_path / MODEL_FILE))
    other, _ = _data(5, 2)  # another batch size than the trace saw
    with torch.no_grad():
        assert torch.equal(traced(other), torch.log_softmax(model.eval()(other), dim=1))


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
def test_a_trace_that_fixed_the_batch_size_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    model = SplitModel(_Unscriptable(trace_fixes_batch=True), 16, 3)
    x, _ = _data(64, 1)
    with pytest.raises(ExportError, match=r"cannot write LogProbabilities as TorchScript .*trace: .*"):
        export_model(tmp_path, model, example_input=x, architecture="pkg.mod:own")
    assert _files(tmp_path) == []


def test_an_empty_example_batch_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ExportError, match="example batch is empty"):
        export_model(tmp_path, build_model("mlp", SHAPE, 3), example_input=torch.zeros((0, *SHAPE)),
                     architecture="mlp")


def test_the_live_model_is_left_unchanged(tmp_path: Path) -> None:
    model = build_model("fedgen_cnn", SHAPE, 3, seed=3)  # batch norm: eval mode matters
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, _ = _data(16, 0)
    export_model(tmp_path, model, example_input=x, architecture="fedgen_cnn")
    assert model.training and all(m.training for m in model.modules())
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.device.type == "cpu" for p in model.parameters())
    # Exported in eval mode: batch norm uses its running statistics.
    with torch.no_grad():
        assert torch.equal(torch.jit.load(str(tmp_path / MODEL_FILE))(x), torch.log_softmax(model.eval()(x), dim=1))


def test_a_probabilistic_model_is_recognised_although_its_head_is_a_submodule() -> None:
    # Python 3.12's isinstance on a runtime-checkable Protocol looks members up statically: an nn.Module's
    # submodules are not attributes there, so a Protocol check exported FedSR's models with a random draw of z
    # per call (seen on the lent GPU machine's Python 3.12). The check must read them dynamically.
    import inspect

    from hetfed.client.algorithms.fedsr.losses import build_probabilistic_model
    from hetfed.client.export import SampledLogProbabilities, is_gaussian_latent, predictor
    from hetfed.client.models import encoder_builder

    model = build_probabilistic_model(encoder_builder("mlp"), SHAPE, 8, 3, seed=0)
    assert inspect.getattr_static(model, "head", None) is None  # what a static lookup sees
    assert is_gaussian_latent(model)
    assert isinstance(predictor(model)[0], SampledLogProbabilities)
    assert not is_gaussian_latent(build_model("mlp", SHAPE, 3, seed=0))


def test_a_probabilistic_model_exports_the_mean_softmax_over_draws_fixed_at_export(tmp_path: Path) -> None:
    from hetfed.client.algorithms.fedsr.losses import build_probabilistic_model, predict_proba
    from hetfed.client.models import encoder_builder

    model = build_probabilistic_model(encoder_builder("mlp"), SHAPE, 8, 3, seed=0).eval()
    x, _ = _data(32, 0)
    card = json.loads(export_model(tmp_path, model, example_input=x, architecture="mlp", samples=7).read_text())
    assert "over 7 draws of z" in card["output"] and card["latent_dim"] == 8
    exported = torch.jit.load(str(tmp_path / MODEL_FILE))
    noise = torch.randn((7, 8), generator=torch.Generator().manual_seed(NOISE_SEED))
    with torch.no_grad():
        mu, sigma = model.distribution(x)
        probs = torch.softmax(model.head(mu + sigma * noise[:, None, :]), dim=-1).mean(dim=0)
        out = exported(x)
        torch.testing.assert_close(out, torch.log(probs), rtol=1e-6, atol=1e-6)
        assert torch.equal(exported(x), out)  # deterministic: the same input, the same prediction
        # The same estimator as the evaluation's (mean softmax of sampled z): close to it with many draws.
        many = predict_proba(model, x, num_samples=4000, generator=torch.Generator().manual_seed(1))
        assert float((out.exp() - many).abs().max()) < 0.25


# --------------------------------------------------------------------------- the key test: without hetfed
def test_the_torchscript_file_reproduces_the_reported_accuracy_where_hetfed_is_not_importable(
        tmp_path: Path) -> None:
    model = build_model("mlp", SHAPE, 3, seed=0)
    # A hard problem (neither 0 nor 1 is the answer), more test examples than one evaluation batch.
    train, test = DeviceData(*_data(300, 0, signal=0.2)), DeviceData(*_data(1500, 1, signal=0.2))
    cfg = FedAvgConfig(local_epochs=2, lr=0.1)
    fit([Objective(model, make_optimizer(trainable(model), cfg))], epoch_batches(train, cfg, np.random.default_rng(0)))
    reported, _ = evaluate(model, test)  # what hetfed reports
    assert 0.5 < reported < 1.0
    export_model(tmp_path / "model", model, example_input=test.x[:64], architecture="mlp",
                 accuracy={"test_accuracy": reported})
    torch.save({"x": test.x, "y": test.y}, tmp_path / "test.pt")
    proc = _fresh_python(tmp_path, """
        import json, sys
        try:
            import hetfed
        except ImportError:
            pass
        else:
            sys.exit("hetfed is importable here: " + str(hetfed.__path__))
        import torch
        card = json.load(open("model/card.json"))
        assert "model.ts" in card["files"]
        model = torch.jit.load("model/model.ts")
        data = torch.load("test.pt", weights_only=True)
        correct = 0
        with torch.no_grad():
            for i in range(0, len(data["y"]), 1024):
                correct += int((model(data["x"][i:i + 1024]).argmax(dim=1) == data["y"][i:i + 1024]).sum())
        print(json.dumps({"accuracy": correct / len(data["y"]), "card": card["accuracy"]["test_accuracy"],
                          "path": sys.path}))
    """)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not any("work/main" in p for p in out["path"])
    assert out["accuracy"] == out["card"] == reported


# -------------------------------------------------------------------------------- the runtime's pieces
def test_traffic_totals_sum_the_client_counters_of_one_organization_by_direction() -> None:
    registry = CollectorRegistry()
    traffic = TrafficMetrics(registry, "client")

    def b(**kinds: int) -> TrafficBreakdown:
        return TrafficBreakdown({k: KindCount(v, 1) for k, v in kinds.items()})

    traffic.record("r", "unknown", "o", "up", b(envelope=10))  # before Join the algorithm label is unknown
    traffic.record("r", "a", "o", "up", b(model_weights=100, envelope=7))
    traffic.record("r", "a", "o", "down", b(model_weights=200, envelope=3))
    traffic.record("r", "a", "other", "up", b(model_weights=1000))
    traffic.record("r2", "a", "o", "up", b(model_weights=1000))
    assert traffic_totals(registry, "r", "o") == {"up": 117, "down": 203}
    assert traffic_totals(registry, "r", "nobody") == {"up": 0, "down": 0}


def test_the_card_reports_test_and_held_out_set_accuracies_only() -> None:
    m = EvalMetrics(test_accuracy=0.8, extra={"global_test_accuracy": 0.7, "global_model_test_accuracy": 0.6,
                                              "global_test_loss": 1.0, "evaluated_round": 3.0})
    # global_model_test_accuracy is another model's (a global model beside the personal one): not this one's.
    assert accuracies(m, ["global_test", "cross_test"]) == {"test_accuracy": 0.8, "global_test_accuracy": 0.7}


def test_without_output_dir_nothing_is_exported_and_one_line_says_where_to_set_it(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="hetfed.client"):
        assert export_after_run(ClientConfig(organization="o", run="r"), None, "a", 3,  # type: ignore[arg-type]
                                EvalMetrics(), CollectorRegistry()) is None
    assert [r.getMessage() for r in caplog.records] == [
        "o: no model exported: set output_dir in the client config to write the trained model (docs/export.md)"]


# ------------------------------------------------------------------------------------------ hetfed export
def _export_tree(root: Path) -> None:
    x, _ = _data(8, 0)
    for i, acc in enumerate((0.5, 0.875)):
        export_model(root / "artifacts" / "fedavg" / f"org-{i}" / "model", build_model("mlp", SHAPE, 3, seed=i),
                     example_input=x, architecture="mlp", run="fedavg", organization=f"org-{i}", algorithm="fedavg",
                     rounds=2, accuracy={"test_accuracy": acc}, bytes_sent=1500 * (i + 1), bytes_received=2_500_000)
    (root / "other").mkdir()
    (root / "other" / CARD_FILE).write_text('{"format": "someone else\'s"}')


def _hetfed(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", "import sys; from hetfed.cli import main; rc = main(sys.argv[1:]); "
                           "assert 'torch' not in sys.modules, 'hetfed export imported torch'; sys.exit(rc)", *args],
                          capture_output=True, text=True, timeout=120)


def test_hetfed_export_lists_every_exported_model_from_the_cards_alone(tmp_path: Path) -> None:
    _export_tree(tmp_path)
    proc = _hetfed("export", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 2
    assert lines[0].split()[:5] == ["org-0", "fedavg", "test", "accuracy", "0.5000"]
    assert "sent    1.5 kB  received    2.5 MB" in lines[0]
    assert lines[1].startswith("org-1") and "0.8750" in lines[1]
    assert lines[1].endswith(str(tmp_path / "artifacts" / "fedavg" / "org-1" / "model"))

    proc = _hetfed("export", str(tmp_path), "--json", "--verify")
    assert proc.returncode == 0, proc.stderr
    listed = json.loads(proc.stdout)
    assert [(m["organization"], m["accuracy"]["test_accuracy"], m["verified"]) for m in listed] == [
        ("org-0", 0.5, True), ("org-1", 0.875, True)]
    assert listed[0]["path"] == str(tmp_path / "artifacts" / "fedavg" / "org-0" / "model")


def test_hetfed_export_verify_names_a_file_that_changed_and_an_empty_tree_exits_1(tmp_path: Path) -> None:
    _export_tree(tmp_path)
    state = tmp_path / "artifacts" / "fedavg" / "org-1" / "model" / STATE_FILE
    state.write_bytes(state.read_bytes() + b"x")
    proc = _hetfed("export", str(tmp_path), "--verify")
    assert proc.returncode == 1
    assert proc.stdout.splitlines()[0].endswith("(verified)")
    assert proc.stdout.splitlines()[1].endswith(f"({STATE_FILE} does not match its SHA-256)")
    (tmp_path / "empty").mkdir()
    proc = _hetfed("export", str(tmp_path / "empty"))
    assert proc.returncode == 1 and "no exported model under" in proc.stderr
    assert _hetfed("export", str(tmp_path / "missing")).returncode == 2


# ------------------------------------------------------------------------------------------- end to end
@pytest.mark.e2e
def test_a_local_run_exports_each_organizations_model_reproducing_its_reported_accuracy(tmp_path: Path) -> None:
    from hetfed.cli.localrun import LocalRunOptions, federate
    from hetfed.client.config import load_client_config
    from hetfed.client.data import ArrayDataset, DataConfig, load_client_data

    opts = LocalRunOptions(algorithms=("fedavg",), clients=2, rounds=2, dataset="digits", partition="iid",
                           models=("mlp",), train={"local_epochs": 1}, artifacts=True, quiet=True)
    (summary,) = federate(opts, tmp_path)
    final = summary["rounds"][-1]["per_organization"]
    for i in range(2):
        org = f"org-{i}"
        folder = tmp_path / "artifacts" / "fedavg" / org / "model"
        card = json.loads((folder / CARD_FILE).read_text())
        assert (card["organization"], card["algorithm"], card["run"], card["rounds"]) == (org, "fedavg", "fedavg", 2)
        assert card["architecture"] == "mlp" and card["input_shape"] == [1, 8, 8] and card["num_classes"] == 10
        assert card["accuracy"]["test_accuracy"] == final[org]["test_accuracy"]
        assert card["accuracy"]["global_test_accuracy"] == final[org]["global_test_accuracy"]
        assert card["bytes"]["sent"] > 0 and card["bytes"]["received"] > card["bytes"]["sent"] / 2
        # The organization's own test set, rebuilt from the client config the run wrote for it.
        cfg = load_client_config(tmp_path / f"client-fedavg-{org}.json")
        assert Path(cfg.output_dir or "") == Path("artifacts") / "fedavg" / org  # relative to the run's folder
        data = load_client_data(DataConfig(**dataclasses.asdict(cfg.data)))
        assert card["num_test_examples"] == len(data.test)
        model = torch.jit.load(str(folder / MODEL_FILE))
        assert isinstance(data.test, ArrayDataset)
        x, y = torch.as_tensor(data.test.x), torch.as_tensor(data.test.y)
        with torch.no_grad():
            correct = sum(int((model(x[s : s + 1024]).argmax(dim=1) == y[s : s + 1024]).sum())
                          for s in range(0, len(y), 1024))
        assert correct / len(y) == card["accuracy"]["test_accuracy"]


# ------------------------------------------------------------------------------------------- under DP
def test_a_dp_trained_model_exports_once_its_hooks_are_released_and_its_card_says_its_epsilon(tmp_path: Path) -> None:
    """Opacus' backward hooks stop TorchScript; the session takes them off before the export, which then writes
    the organization's (ε, δ, σ, C) into the card."""
    from hetfed.client.privacy.config import PrivacyConfig
    from hetfed.client.privacy.session import PrivacySession
    from hetfed.client.training import DeviceData, Objective, epoch_batches, fit
    from hetfed.wire.specs.fedavg import FedAvgConfig

    x, y = _data(64, 0)
    session = PrivacySession(PrivacyConfig(noise_multiplier=1.0, noise_seed=3), "r1", "org-0", None, 64,
                             torch.device("cpu"))
    session.release_examples()  # N̂, before Join, as the runtime does
    session.set_batch_size(16)
    session.plan("dp-sgd", [], [], 1)
    model = build_model("mlp", SHAPE, 3, seed=1)
    data = session.wrap(DeviceData(x, torch.as_tensor(y)))
    session.begin_round(1, 7)
    fit([Objective(model, torch.optim.SGD(model.parameters(), lr=0.1))],
        epoch_batches(data, FedAvgConfig(local_steps=2, batch_size=16), np.random.default_rng(0)))
    figures = {"epsilon": session.close_round(1).epsilon, "delta": session.delta, "noise_multiplier": 1.0,
               "clip_norm": 1.0}
    def export(folder: Path) -> Path:
        return export_model(folder, model, example_input=x, architecture="mlp", run="r1", organization="org-0",
                            algorithm="fedavg", rounds=1, accuracy={}, num_test_examples=64, bytes_sent=1,
                            bytes_received=1, dataset="toy", privacy=figures)

    with pytest.raises(ExportError):
        export(tmp_path / "hooked")
    session.release()
    card = json.loads(export(tmp_path / "model").read_text())
    assert card["privacy"] == {**figures, "differentially_private": True} and figures["epsilon"] > 0
    # A model trained outside DP in the same run (a personal model kept in the organization) gets no ε.
    from hetfed.client.export import NOT_DP_NOTE

    kept = export_model(tmp_path / "kept", model, example_input=x, architecture="mlp", privacy=figures,
                        model_under_dp=False)
    assert json.loads(kept.read_text())["privacy"] == {"differentially_private": False, "note": NOT_DP_NOTE}
