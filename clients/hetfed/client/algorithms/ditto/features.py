"""Where Ditto's drift measures take their features: forward hooks on named layers, refit samples, the schedule."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from hetfed.client.models import SplitModel


def named_layer(model: nn.Module, layer: str) -> nn.Module:
    """The sub-module called ``layer`` (a ``named_modules`` name), with a clear error listing the names."""
    modules = dict(model.named_modules())
    if layer not in modules or layer == "":
        names = [n for n in modules if n]
        raise ValueError(f"model has no layer {layer!r}; its layers are: {', '.join(names)}")
    return modules[layer]


def forward_with_layers(
    model: nn.Module, layers: Sequence[str], x: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(the model's output on x, each named layer's output flattened to (B, −1)) from one forward pass.

    ``""`` means a SplitModel's encoder output: features = ``model.embed(x)``, output = ``model.head`` of them.
    Other names are ``named_modules`` names whose outputs forward hooks catch; each must run once per pass.
    """
    named = [layer for layer in layers if layer != ""]
    modules = {layer: named_layer(model, layer) for layer in named}
    caught: dict[str, list[torch.Tensor]] = {layer: [] for layer in named}
    handles = []
    for layer, module in modules.items():
        def hook(_m: nn.Module, _i: object, o: torch.Tensor, layer: str = layer) -> None:
            caught[layer].append(o)

        handles.append(module.register_forward_hook(hook))
    feats: dict[str, torch.Tensor] = {}
    try:
        if "" in layers:
            if not isinstance(model, SplitModel):
                raise ValueError("feature layer '' needs a model with embed(x) and a head (hetfed's SplitModel)")
            z = model.embed(x)
            out: torch.Tensor = model.head(z)
            feats[""] = z.flatten(1)
        else:
            out = model(x)
    finally:
        for h in handles:
            h.remove()
    for layer in named:
        got = caught[layer]
        if len(got) != 1 or not isinstance(got[0], torch.Tensor):
            raise ValueError(f"layer {layer!r} must produce one tensor per forward pass, it produced {len(got)}")
        feats[layer] = got[0].flatten(1)
    return out, {layer: feats[layer] for layer in layers}


def forward_with_features(model: nn.Module, layer: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the model's output on x, the named layer's output flattened to (B, −1)) from one forward pass.

    ``layer == ""`` means a SplitModel's encoder output (see :func:`forward_with_layers`).
    """
    out, feats = forward_with_layers(model, (layer,), x)
    return out, feats[layer]


@torch.no_grad()
def gather_features(
    local: nn.Module, reference: nn.Module, layer: str, batches: Iterable[torch.Tensor], max_batches: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Features of both models on up to ``max_batches`` input batches, in eval mode, without gradients.

    The kernel-refit sample (§5: "updated every 20 steps using s batches"); both models' train/eval modes are
    restored afterwards.
    """
    if int(max_batches) < 1:
        raise ValueError(f"max_batches must be >= 1, got {max_batches}")
    modes = (local.training, reference.training)
    local.eval()
    reference.eval()
    fl: list[torch.Tensor] = []
    fg: list[torch.Tensor] = []
    try:
        for i, xb in enumerate(batches):
            if i >= max_batches:
                break
            fl.append(forward_with_features(local, layer, xb)[1])
            fg.append(forward_with_features(reference, layer, xb)[1])
    finally:
        local.train(modes[0])
        reference.train(modes[1])
    if not fl:
        raise ValueError("gather_features got no batches")
    return torch.cat(fl), torch.cat(fg)


@dataclass(frozen=True)
class RefitSchedule:
    """When kernels are refit: every ``every`` local steps on features of ``batches`` batches, or every step (−1).

    ``every = -1`` is the paper's MK-MMD₋₁ (each step, on the current batch); ``every = 20, batches = 50`` is
    MK-MMD₂₀ and the paper's MMD-D setting. Steps count from 0 within a round, so a refit comes before steps
    0, 20, 40, … (the reference code refits after its steps 1, 21, 41, … and gathers s + 1 batches).
    """

    every: int = 20
    batches: int = 50

    def __post_init__(self) -> None:
        if isinstance(self.every, bool) or not isinstance(self.every, int) or (self.every != -1 and self.every < 1):
            raise ValueError(f"refit every must be -1 (each step) or a positive number of steps, got {self.every!r}")
        if isinstance(self.batches, bool) or not isinstance(self.batches, int) or self.batches < 1:
            raise ValueError(f"refit batches (s) must be a positive int, got {self.batches!r}")

    @property
    def per_step(self) -> bool:
        """Whether kernels are refit on every step's own batch."""
        return self.every == -1

    def due(self, step: int) -> bool:
        """Whether a periodic refit on gathered features comes before local step ``step`` (0-based in the round)."""
        return not self.per_step and step % self.every == 0
