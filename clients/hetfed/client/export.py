"""Taking a trained model out: the model an organization would deploy, as files that load without hetfed.

At the end of a run, a client whose ``output_dir`` is set writes ``<output_dir>/model/``:

- ``model.ts``: TorchScript (``torch.jit.script``, else ``torch.jit.trace`` on a batch of real held-out
  examples). Its forward takes a float batch shaped like the data and returns the log-probabilities
  (N, num_classes) hetfed's evaluation predicts from; their argmax is the predicted class. Saved on CPU.
- ``state_dict.pt``: the model's ``state_dict`` (plain tensors, loadable with ``weights_only=True``), for
  rebuilding the architecture with hetfed.
- ``card.json``: what the model is and what it reached (architecture, run, organization, algorithm, rounds,
  held-out accuracies, bytes sent and received, shapes, torch version, file names with SHA-256, how to load).

Every file is written to a temporary name and renamed into place; the card comes last, so a card names
complete files. The TorchScript file is reloaded and checked against the live model before it is kept.
Nothing here is sent anywhere.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import warnings
from collections.abc import Callable, Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

import numpy as np
import torch
from prometheus_client import CollectorRegistry
from torch import nn

from hetfed.client.card import CARD_FILE, CARD_FORMAT, file_sha256
from hetfed.client.training import eval_mode
from hetfed.wire.payloads import EvalMetrics
from hetfed.wire.traffic import Direction

if TYPE_CHECKING:
    from hetfed.client.algorithms.base import ClientHalf
    from hetfed.client.config import ClientConfig

log = logging.getLogger("hetfed.client")

EXPORT_DIR = "model"
"""The folder under a client's ``output_dir`` that holds its exported model."""
MODEL_FILE = "model.ts"
STATE_FILE = "state_dict.pt"
EXAMPLES = 64
"""Held-out examples the export traces on (when scripting fails) and checks the saved file with."""
SAMPLES = 20
"""Draws of z a probabilistic model's exported prediction averages (FedSR's default ``num_samples``)."""
NOISE_SEED = 0
"""Seed of those draws: fixed at export, so the exported prediction is deterministic."""
PRIVACY_KEYS = ("epsilon", "delta", "noise_multiplier", "clip_norm")
"""What the card's ``privacy`` holds: the last reported ``privacy_<key>`` figures of a client under DP."""


class ExportError(RuntimeError):
    """The model could not be written as a TorchScript file that reproduces it."""


class LogProbabilities(nn.Module):
    """hetfed's prediction from a model's logits: log-softmax over the classes (``training.evaluate``'s default)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Log-probabilities (N, num_classes)."""
        return torch.log_softmax(self.model(x), dim=1)


class GaussianLatent(Protocol):
    """A model whose latent is a Gaussian p(z|x) = N(μ(x), σ(x)²) with a linear head on z (a probabilistic
    SplitModel): it predicts by averaging the softmax of the head over draws of z."""

    head: nn.Module
    latent_dim: int

    def distribution(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(μ, σ) of p(z|x), each (N, latent_dim)."""
        ...


def is_gaussian_latent(model: nn.Module) -> bool:
    """Whether ``model`` has GaussianLatent's members. Not ``isinstance`` on a runtime-checkable Protocol: from
    Python 3.12 that looks members up statically and misses an ``nn.Module``'s submodules (``head``), which
    live in its ``_modules``."""
    return (callable(getattr(model, "distribution", None)) and isinstance(getattr(model, "head", None), nn.Module)
            and isinstance(getattr(model, "latent_dim", None), int))


class SampledLogProbabilities(nn.Module):
    """log of the mean over fixed draws ε_s of softmax(head(μ(x) + σ(x)·ε_s)): the estimator a probabilistic
    model's evaluation uses (mean softmax over ``samples`` draws of z), with the draws fixed at export (a
    buffer), so that the same input always gets the same prediction."""

    def __init__(self, model: nn.Module, noise: torch.Tensor) -> None:
        super().__init__()
        self.model = model
        self.register_buffer("noise", noise)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Log-probabilities (N, num_classes)."""
        mu, sigma = self.model.distribution(x)  # type: ignore[operator]
        z = mu.unsqueeze(0) + sigma.unsqueeze(0) * self.noise.unsqueeze(1)  # type: ignore[operator]
        probs = torch.softmax(self.model.head(z), dim=-1).mean(dim=0)  # type: ignore[operator]
        return torch.log(probs.clamp_min(1.1754943508222875e-38))  # float32's tiny, as the evaluation clamps


def predictor(model: nn.Module, *, samples: int = SAMPLES) -> tuple[nn.Module, str]:
    """The module whose forward is the prediction hetfed's evaluation makes with ``model`` (around ``model``
    itself, on its device), and a one-line description of that prediction for the card."""
    if is_gaussian_latent(model):
        gen = torch.Generator().manual_seed(NOISE_SEED)
        noise = torch.randn((samples, int(cast(GaussianLatent, model).latent_dim)), generator=gen)
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        return (SampledLogProbabilities(model, noise.to(device)),
                f"log of the mean softmax of the head over {samples} draws of z ~ N(mu(x), sigma(x)^2), the draws "
                f"fixed at export (seed {NOISE_SEED})")
    return LogProbabilities(model), "log_softmax of the model's logits"


@contextlib.contextmanager
def _quiet_jit() -> Iterator[None]:
    """TorchScript's deprecation warnings silenced (the export uses it on purpose: files that load anywhere)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*is deprecated.*", category=DeprecationWarning)
        yield


def _atomic(path: Path, write: Callable[[Path], object]) -> None:
    """Write ``path`` through a temporary file in the same folder, renamed into place."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@torch.no_grad()
def _outputs(module: nn.Module | torch.jit.ScriptModule, x: torch.Tensor) -> torch.Tensor:
    out = module(x)
    if not isinstance(out, torch.Tensor):
        raise ExportError(f"the exported module returns {type(out).__name__}, not a tensor")
    return out.detach().float().cpu()


def _mismatch(got: torch.Tensor, want: torch.Tensor, *, exact_classes: bool) -> str | None:
    """Why ``got`` is not ``want`` (None when it is): shapes, values beyond tolerance, or another argmax."""
    if got.shape != want.shape:
        return f"output shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    tol = 1e-5 if exact_classes else 1e-2  # another device (TF32 convolutions on CUDA) rounds differently
    if not torch.allclose(got, want, rtol=tol, atol=tol, equal_nan=True):
        worst = float((got - want).abs().nan_to_num(0.0).max())
        return f"outputs differ by up to {worst:.3g} (tolerance {tol:g})"
    if exact_classes and got.dim() == 2 and not torch.equal(got.argmax(dim=1), want.argmax(dim=1)):
        return "the predicted classes differ"
    return None


def _candidates(module: nn.Module, x: torch.Tensor) -> list[tuple[str, Callable[[], torch.jit.ScriptModule]]]:
    """Ways to make TorchScript of ``module`` (on CPU, in eval mode), in order: script it, trace it on ``x``."""
    return [("script", lambda: torch.jit.script(module)),
            ("trace", lambda: torch.jit.trace(module, (x,), check_trace=False))]


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"


def _write_torchscript(path: Path, module: nn.Module, checks: list[tuple[torch.Tensor, torch.Tensor]],
                       exact_classes: bool) -> str:
    """Save the first TorchScript form of ``module`` whose reloaded file gives ``want`` on each ``(x, want)`` of
    ``checks`` (the first ``x`` is what a trace sees); returns how it was made ("script" or "trace");
    ExportError when neither reproduces the model."""
    problems = []
    tmp = path.with_name(f".{path.name}.tmp")
    for how, make in _candidates(module, checks[0][0]):
        try:
            with _quiet_jit():
                compiled = make()
                torch.jit.save(compiled, str(tmp))
                reloaded = torch.jit.load(str(tmp), map_location="cpu")
            reloaded.eval()
            why = next((w for xi, want in checks
                        if (w := _mismatch(_outputs(reloaded, xi), want, exact_classes=exact_classes)) is not None),
                       None)
        except Exception as exc:  # what TorchScript cannot compile, or a compiled module that fails on the examples
            why = _one_line(exc)
        if why is None:
            os.replace(tmp, path)
            return how
        tmp.unlink(missing_ok=True)
        problems.append(f"{how}: {why}")
    raise ExportError(f"cannot write {type(module).__name__} as TorchScript that reproduces the live model on the "
                      f"example batch ({'; '.join(problems)})")


def export_model(out_dir: str | Path, model: nn.Module, *, example_input: torch.Tensor, architecture: str,
                 run: str = "", organization: str = "", algorithm: str = "", rounds: int = 0,
                 accuracy: Mapping[str, float] | None = None, num_test_examples: int = 0,
                 bytes_sent: int = 0, bytes_received: int = 0, dataset: str = "",
                 samples: int = SAMPLES, privacy: dict[str, float] | None = None, model_under_dp: bool = True) -> Path:
    """Write ``model.ts``, ``state_dict.pt`` and ``card.json`` for ``model`` into ``out_dir``; returns the card's
    path. ``example_input``: a batch of real held-out inputs (any device). The live model stays where it is,
    unchanged and in its mode; the files hold a CPU copy. ExportError when TorchScript cannot reproduce it.
    ``privacy``: the organization's (ε, δ, σ, C) under DP; ``model_under_dp``: whether ``model`` itself was trained
    under DP, so that the card carries ε only for a model it covers."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if example_input.dim() < 1 or int(example_input.shape[0]) < 1:
        raise ExportError(f"the example batch is empty (shape {tuple(example_input.shape)}): the export needs at "
                          "least one held-out example to check the saved model")
    live_device = next((p.device for p in model.parameters()), torch.device("cpu"))
    exact = live_device.type == "cpu"
    x = example_input.detach().to("cpu")
    live, _ = predictor(model, samples=samples)
    checks = []
    with eval_mode(model):
        try:
            checks.append((x, _outputs(live, x.to(live_device))))
        except Exception as exc:  # ExportError included: a live model that cannot predict is not exported
            raise ExportError(f"the model fails on the example batch: {_one_line(exc)}") from exc
        if x.shape[0] > 1:  # a second batch size, where the live model takes it: a trace that fixed it shows here
            with contextlib.suppress(Exception):
                checks.append((x[:1], _outputs(live, x[:1].to(live_device))))
    cpu_model = copy.deepcopy(model).to("cpu").eval()
    module, rule = predictor(cpu_model, samples=samples)
    module.eval()
    how = _write_torchscript(out / MODEL_FILE, module, checks, exact)

    state = {k: v.detach().clone() for k, v in cpu_model.state_dict().items()}
    _atomic(out / STATE_FILE, lambda p: torch.save(state, p))

    shape = [int(s) for s in x.shape[1:]]
    files = {name: {"sha256": file_sha256(out / name), "bytes": (out / name).stat().st_size}
             for name in (MODEL_FILE, STATE_FILE)}
    card: dict[str, Any] = {
        "format": CARD_FORMAT,
        "run": run,
        "organization": organization,
        "algorithm": algorithm,
        "rounds": int(rounds),
        "architecture": architecture,
        "dataset": dataset,
        "accuracy": {k: float(v) for k, v in (accuracy or {}).items()},
        "num_test_examples": int(num_test_examples),
        "bytes": {"sent": int(bytes_sent), "received": int(bytes_received)},
        # The (ε, δ) of what this organization sent (docs/privacy.md), None without DP. A model trained outside
        # DP (kept in the organization) gets no ε: the organization's ε covers its uploads, not this model.
        "privacy": card_privacy(privacy, model_under_dp),
        "input_shape": shape,
        "input_dtype": str(x.dtype).removeprefix("torch."),
        "num_classes": int(getattr(cpu_model, "num_classes", checks[0][1].shape[-1])),
        "latent_dim": int(getattr(cpu_model, "latent_dim", 0)),
        "output": f"log-probabilities (N, num_classes): {rule}; argmax over dim 1 is the predicted class",
        "torchscript": how,
        "torch_version": torch.__version__,
        "exported_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "files": files,
        "load": f"import torch; classes = torch.jit.load('{MODEL_FILE}').eval()(x).argmax(dim=1)"
                f"  # x: {str(x.dtype).removeprefix('torch.')} tensor (N, {', '.join(map(str, shape))})",
    }
    card_path = out / CARD_FILE
    _atomic(card_path, lambda p: p.write_text(json.dumps(card, indent=1) + "\n"))
    return card_path


NOT_DP_NOTE = ("this model was trained outside differential privacy (it never left the organization); the "
               "organization's ε covers what it sent, not this model")
"""What a card says of a model trained outside DP in a run under DP."""


def card_privacy(privacy: Mapping[str, float] | None, model_under_dp: bool) -> dict[str, Any] | None:
    """The card's ``privacy``: None without DP; the (ε, δ, σ, C) with ``differentially_private: true`` for a
    model trained under DP; ``differentially_private: false`` and a note, without ε, for one trained outside."""
    if not privacy:
        return None
    if not model_under_dp:
        return {"differentially_private": False, "note": NOT_DP_NOTE}
    return {**privacy, "differentially_private": True}


def traffic_totals(registry: CollectorRegistry, run: str, organization: str, side: str = "client") -> dict[str, int]:
    """Bytes ``side`` counted for ``organization`` in ``run``, by direction ("up", "down"), from the registry's
    ``hetfed_<side>_bytes_total`` counters (``hetfed.wire.traffic.TrafficMetrics``)."""
    totals = {d.value: 0 for d in Direction}
    for family in registry.collect():
        if family.name != f"hetfed_{side}_bytes":
            continue
        for s in family.samples:
            if (s.name.endswith("_total") and s.labels.get("run") == run
                    and s.labels.get("organization") == organization and s.labels.get("direction") in totals):
                totals[s.labels["direction"]] += int(s.value)
    return totals


def accuracies(metrics: EvalMetrics, sets: list[str]) -> dict[str, float]:
    """``test_accuracy`` and each held-out set's ``<set>_accuracy`` that ``metrics`` reports."""
    out = {"test_accuracy": float(metrics.test_accuracy)}
    for name in sets:
        if f"{name}_accuracy" in metrics.extra:
            out[f"{name}_accuracy"] = float(metrics.extra[f"{name}_accuracy"])
    return out


def export_after_run(cfg: ClientConfig, half: ClientHalf, algorithm: str, evaluate_round: int,  # type: ignore[type-arg]
                     metrics: EvalMetrics, registry: CollectorRegistry) -> Path | None:
    """The runtime's end of a run: export ``half.deployed_model()`` into ``<output_dir>/model/`` with the final
    evaluation's figures; logs (and returns None) when ``output_dir`` is unset or the export fails."""
    if not cfg.output_dir:
        log.info("%s: no model exported: set output_dir in the client config to write the trained model "
                 "(docs/export.md)", cfg.organization)
        return None
    ctx = half.ctx
    source = ctx.test if len(ctx.test) else ctx.train
    if not len(source):
        log.warning("%s: no model exported: no example to check it with (empty test and train sets)",
                    cfg.organization)
        return None
    traffic = traffic_totals(registry, cfg.run, cfg.organization)
    try:
        path = export_model(
            Path(cfg.output_dir) / EXPORT_DIR, half.deployed_model(),
            example_input=source.take(np.arange(min(len(source), EXAMPLES))).x,
            architecture=cfg.model.reference, run=cfg.run, organization=cfg.organization, algorithm=algorithm,
            rounds=evaluate_round - 1, accuracy=accuracies(metrics, list(ctx.data.eval_sets())),
            num_test_examples=metrics.num_test_examples, bytes_sent=traffic[Direction.UP.value],
            bytes_received=traffic[Direction.DOWN.value], dataset=ctx.data.name,
            # A run whose evaluation averages draws of a probabilistic latent sets how many (``num_samples``).
            samples=int(getattr(half.config, "num_samples", SAMPLES)),
            privacy={key: float(metrics.extra[f"privacy_{key}"]) for key in PRIVACY_KEYS
                     if f"privacy_{key}" in metrics.extra},
            model_under_dp=half.deployed_under_dp)
    except (ExportError, OSError) as exc:
        log.error("%s: the trained model could not be exported: %s", cfg.organization, exc)
        return None
    log.info("%s: trained model exported to %s", cfg.organization, path.parent)
    return path
