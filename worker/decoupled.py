"""Decoupled training with synthetic intermediate labels (issue 19 §2, the training rule).

A model that is a chain of layers (an ``nn.Sequential``) is cut into ``K`` segments. Each
class gets, at every cut, a fixed random target vector (its *synthetic label*, drawn from
the study seed). Segment 1 learns to map an input to the synthetic label of its class at
the first cut; segment ``j`` learns to map the synthetic label at cut ``j - 1`` (with a
little Gaussian noise, so that it also maps the imperfect outputs of the segment before
it) to the one at cut ``j``; the last segment maps the last cut's label to the true class.
The segments exchange no activations and no gradients while they train, so each is a unit
of work of its own: it needs only its own weights, its own activations and the labels.
The composed model, segment after segment, is what is evaluated.

This module holds the rule: where to cut, the labels, each segment's inputs, targets and
loss, and how the states of a trial's segments, trained apart, make the trial's
(:func:`merge_segments`). ``bench/decoupled.py`` measures it against end-to-end training;
``worker/segment_units.py`` runs segments as units of work of their own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from packtune.spilling import plan_shards

#: standard deviation of the noise added to a segment's synthetic inputs
NOISE = 0.1


def cut_points(model: nn.Sequential, segments: int) -> list[range]:
    """``segments`` runs of consecutive layers of ``model`` with about equal parameter counts,
    each starting at a layer with parameters (activations stay with the layer before)."""
    layers = list(model)
    starts = [0] + [i for i, layer in enumerate(layers) if i > 0 and _params(layer)]
    if len(starts) < segments:
        raise ValueError(
            f"a model of {len(starts)} layers with parameters cannot be cut into {segments} "
            "segments"
        )
    blocks = [range(a, b) for a, b in zip(starts, [*starts[1:], len(layers)], strict=True)]
    costs = [sum(_params(layers[i]) for i in block) for block in blocks]
    # the smallest bound that cuts the blocks into at most `segments` runs (bisection over
    # the greedy planner), then split the largest runs until there are exactly that many
    lo, hi = max(costs), sum(costs)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(plan_shards(costs, 2 * mid)) <= segments:
            hi = mid
        else:
            lo = mid + 1
    runs = plan_shards(costs, 2 * lo)
    while len(runs) < segments:
        i = max((r for r in range(len(runs)) if len(runs[r]) > 1), key=lambda r: len(runs[r]))
        run = runs[i]
        runs[i : i + 1] = [range(run.start, run.start + 1), range(run.start + 1, run.stop)]
    return [range(blocks[r.start].start, blocks[r.stop - 1].stop) for r in runs]


def _params(layer: nn.Module) -> int:
    return sum(p.numel() for p in layer.parameters())


def split(model: nn.Sequential, segments: int) -> list[nn.Sequential]:
    """The model's segments (sharing its layers, so its weights are theirs)."""
    layers = list(model)
    return [nn.Sequential(*(layers[i] for i in run)) for run in cut_points(model, segments)]


def synthetic_labels(classes: int, widths: list[int], seed: int) -> list[Tensor]:
    """One ``[classes, width]`` table per cut: each class's target vector, uniform in
    [0, 1) (reachable after a ReLU), fixed by ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.rand(classes, width, generator=gen) for width in widths]


def widths(parts: list[nn.Sequential], example: Tensor) -> list[int]:
    """The output width at each cut (between consecutive segments), for inputs like
    ``example`` (one batch)."""
    out = []
    h = example
    with torch.no_grad():
        for part in parts[:-1]:
            h = part(h)
            out.append(int(h[0].numel()))
    return out


@dataclass(frozen=True)
class Segment:
    """What segment ``index`` of ``count`` trains on: its inputs and targets for a batch's
    inputs ``x`` and classes ``y``, and its loss."""

    index: int
    count: int
    labels: list[Tensor]  # one table per cut
    noise: float = NOISE

    def inputs(self, x: Tensor, y: Tensor, generator: torch.Generator) -> Tensor:
        if self.index == 0:
            return x
        table = self.labels[self.index - 1].to(x.device)
        clean = table[y]
        noise = torch.randn(clean.shape, generator=generator, dtype=clean.dtype).to(x.device)
        return clean + self.noise * noise

    def loss(self, outputs: Tensor, y: Tensor, final: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
        if self.index == self.count - 1:
            return final(outputs, y)
        return F.mse_loss(outputs.flatten(1), self.labels[self.index].to(outputs.device)[y])


def compose(parts: list[nn.Sequential], x: Tensor) -> Tensor:
    """The composed model's output: each segment on the one before's output."""
    for part in parts:
        x = part(x)
    return x


def merge_segments(parts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The trial's state from its segments' (each a segment unit's checkpoint: that
    segment's weights, buffers and optimizer state, all at one step): every segment's
    tensors together, the first segment's random state, and the last one's train loss (the
    trial's, as in an array that trains every segment)."""
    steps = {int(p["steps_done"]) for p in parts}
    if len(steps) != 1:
        raise ValueError(f"segments at different steps: {sorted(steps)}")
    if sorted(int(p["segment"]) for p in parts) != list(range(len(parts))):
        raise ValueError("one state per segment, 0 to K-1, is needed")
    ordered = sorted(parts, key=lambda p: int(p["segment"]))
    first = ordered[0]
    merged = {
        "key": first["key"],
        "config": dict(first["config"]),
        "rng": first["rng"],
        "steps_done": steps.pop(),
        "params": {n: t for p in ordered for n, t in p["params"].items()},
        "buffers": {n: t for p in ordered for n, t in p["buffers"].items()},
        "optimizer": {
            "step": first["optimizer"]["step"],
            "state": {n: v for p in ordered for n, v in p["optimizer"]["state"].items()},
        },
    }
    if "train_loss" in ordered[-1]:
        merged["train_loss"] = float(ordered[-1]["train_loss"])
    python = _merged_python(ordered)
    if python:
        merged["python"] = python
    return merged


def _merged_python(ordered: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """The Python state training changed (``python`` of each segment's state: each holds the
    whole model's): a module's attributes from the segment that trains it (holds its
    weights or buffers; the first that has them otherwise), the workload object's and the
    values kept outside the model from the last segment (whose loss is the trial's)."""
    model: dict[str, Any] = {}
    owned: dict[str, Any] = {}
    for part in ordered:
        values = part.get("python", {}).get("model", {})
        tensors = [*part["params"], *part["buffers"]]
        for full, value in values.items():
            prefix = full.rpartition(".")[0]
            model.setdefault(full, value)
            if any(name.startswith(f"{prefix}.") or not prefix for name in tensors):
                owned.setdefault(full, value)
    out: dict[str, dict[str, Any]] = {}
    if model:
        out["model"] = {**model, **owned}
    # the last segment's (whose loss is the trial's)
    for kind in ("workload", "outside", "workload_held"):
        values = ordered[-1].get("python", {}).get(kind)
        if values:
            out[kind] = dict(values)
    return out
