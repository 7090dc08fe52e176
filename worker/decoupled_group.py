"""Decoupled stacks: the members of a fused stack trained segment by segment, each segment
against synthetic intermediate labels (the rule: :mod:`worker.decoupled`).

A :class:`DecoupledGroup` stands where a :class:`~worker.fused_group.Group` would (the
array's members, stacked); inside it every segment is a group of its own, with its part of
the stacked weights and buffers, its own stacked optimizer and its own forward, so that the
segments of all members train fused, and no segment sees another's activations or
gradients. A step trains every segment once on the step's batch: the first on the inputs,
the others on the previous cut's synthetic labels of the batch's classes (with noise drawn
from the study seed and the step number: the same whoever shares the array, and after a
resume). The members' recorded loss is the last segment's (against the true classes),
non-finite when any segment's is, so that a member whose segment diverged leaves the array.
Evaluation runs the composed model.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import Tensor, nn

from packtune.spec import TrainingSettings
from packtune.workloads.base import Workload, batch_order_seed
from worker.decoupled import Segment, cut_points, synthetic_labels
from worker.fused_forward import Forward
from worker.fused_group import Group, Stack, backward, full
from worker.module_state import kept_python_state
from worker.optim import StackedOptimizer
from worker.spill import chain_of, stack_forward


def decoupled_problem(
    workload: Workload, template: nn.Module, segments: int, targets: Tensor | None = None
) -> str | None:
    """Why ``template``'s members cannot train decoupled, in one sentence; None if they can.
    ``targets``: the training split's, which must be class labels (a target vector is drawn
    per class; a regression's floats were an IndexError per member)."""
    if workload.streams or workload.custom_step:
        return f"{workload.name} streams its batches or defines its own training_loss()"
    chain = chain_of(template)
    if chain is None:
        return f"{workload.name}'s model is a {type(template).__name__}, not an nn.Sequential"
    try:
        cut_points(nn.Sequential(OrderedDict(chain)), segments)
    except ValueError as exc:
        return str(exc)
    if targets is not None and (
        targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool
    ):
        return (f"its targets are {targets.dtype} values, not class labels: decoupled "
                "training draws a target vector per class")  # fmt: skip
    return None


def _segments(template: nn.Module, segments: int) -> list[nn.Sequential]:
    """``template``'s chain cut where :func:`worker.decoupled.cut_points` cuts it, each
    segment keeping its layers' names in the model."""
    chain = chain_of(template)
    assert chain is not None
    runs = cut_points(nn.Sequential(OrderedDict(chain)), segments)
    return [nn.Sequential(OrderedDict(chain[i] for i in run)) for run in runs]


def _names(sub: nn.Sequential) -> tuple[set[str], set[str]]:
    """The model's names of ``sub``'s parameters and of its buffers."""
    params = {f"{name}.{n}" for name, layer in sub.named_children()
              for n, _ in layer.named_parameters()}  # fmt: skip
    buffers = {f"{name}.{n}" for name, layer in sub.named_children()
               for n, _ in layer.named_buffers()}  # fmt: skip
    return params, buffers


def segment_names(template: nn.Module, segments: int, j: int) -> set[str]:
    """The names of segment ``j``'s parameters and buffers in ``template`` cut into
    ``segments``: what a segment unit puts on its device."""
    subs = _segments(template, segments)
    if not 0 <= j < len(subs):
        raise ValueError(f"segment {j} of a model cut into {len(subs)}")
    params, buffers = _names(subs[j])
    return params | buffers


def _widths(parts: Sequence[nn.Module], example: Tensor) -> list[int]:
    """Each segment's output width per example, from a pass on the meta device."""
    out, h = [], torch.empty(example.shape, dtype=example.dtype, device="meta")
    with torch.no_grad(), kept_python_state(*parts):
        for part in parts:
            h = part(h)
            out.append(int(h[0].numel()))
    return out


_POOLS: dict[int, ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def _pool(threads: int) -> ThreadPoolExecutor:
    """A process-wide pool of ``threads`` threads for the segments' steps (arrays trained
    at once in threads of their own share it)."""
    with _POOLS_LOCK:
        if threads not in _POOLS:
            _POOLS[threads] = ThreadPoolExecutor(threads, thread_name_prefix="packtune-segment")
        return _POOLS[threads]


class _Optimizers:
    """The segments' stacked optimizers, read as one (what checkpoints take)."""

    def __init__(self, groups: list[Group]) -> None:
        self.groups = groups

    @property
    def state(self) -> dict[str, Any]:
        """Every segment's optimizer slots by parameter name (what memory counts)."""
        return {n: slots for g in self.groups for n, slots in g.optimizer.state.items()}

    def member_state(self, i: int) -> dict[str, Any]:
        states = [g.optimizer.member_state(i) for g in self.groups]
        return {"step": states[0]["step"], "state": {n: s for st in states for n, s in
                                                     st["state"].items()}}  # fmt: skip


class DecoupledGroup(Group):
    """Members trained as ``training.segments`` independent segments (see the module)."""

    def __init__(
        self,
        keys: list[Hashable],
        segments: list[Group],
        stacked: list[Forward],
        stack: Stack,
        precision: str,
        labels: list[Tensor],
        training: TrainingSettings,
        data_seed: int,
        only: int | None = None,
    ) -> None:
        self.segments, self.stacked = segments, stacked
        #: the one segment trained (a segment unit, ``units: segment``: ``segments`` then
        #: holds that one alone, so that the others' weights take no memory), or None: all
        self.only = only
        indices = [only] if only is not None else list(range(len(segments)))
        self.rules = [Segment(j, training.segments, labels, training.noise) for j in indices]
        self.data_seed = data_seed
        #: segments trained at once, in threads: on a GPU all (one thread's launches leave
        #: the device idle, another's fill it, as for a pack's arrays: GPU_ARRAY_THREADS); on
        #: a CPU one after another (measured here, digits-mlp 6 layers, one torch thread per
        #: op: 0.57 s in two threads against 0.38-0.46 s in turn, the GIL between small ops)
        self.threads = len(segments) if segments[0].device.type == "cuda" else 1
        params = {n: p for g in segments for n, p in g.params.items()}
        buffers = {n: b for g in segments for n, b in g.buffers.items()}
        super().__init__(keys, params, buffers, segments[0].optimizer, stack, precision)
        self.optimizer = _Optimizers(segments)  # type: ignore[assignment]
        self.proven = True  # a vmap stack that fails here fails its trials (no per-member split)
        self.eval_proven = True  # so does one whose evaluation fails

    def _noise(self, number: int, j: int) -> torch.Generator:
        """The noise of step ``number``'s segment ``j``: from the study seed and the step."""
        return torch.Generator().manual_seed((batch_order_seed(self.data_seed, number) * 31 + j)
                                             % 2**63)  # fmt: skip

    def step(self, batch: Any, workload: Workload, number: int) -> None:
        """Optimizer step ``number`` of every segment on ``batch`` (each on its own inputs),
        the segments at once in threads where that cannot change what they compute (no
        random draws but the noise, which has its own generator)."""
        x, y = batch

        def one(position: int) -> Tensor:
            group = self.segments[position]
            losses = self._segment_losses(position, x, y, workload, number)
            backward(losses, workload.name)
            group.optimizer.step()
            group.optimizer.zero_grad()
            return losses.detach()

        if self.only is not None:  # a segment unit: its loss is the members' recorded one
            self.losses.record(one(0), number)
            return
        if self.threads > 1 and not self.stochastic:
            each = list(_pool(self.threads).map(one, range(len(self.segments))))
        else:
            each = [one(j) for j in range(len(self.segments))]
        # the last segment's loss, made non-finite by any segment's (0 * nan is nan): a
        # member whose segment diverged leaves the array
        self.losses.record(each[-1] + 0 * torch.stack(each[:-1]).sum(dim=0), number)

    def _segment_losses(
        self, position: int, x: Tensor, y: Tensor, workload: Workload, number: int
    ) -> Tensor:
        """The members' ``[k]`` losses of the segment at ``position`` (autograd) on step
        ``number``'s batch ``(x, y)``: against its synthetic labels, the last against ``y``."""
        group, rule = self.segments[position], self.rules[position]
        j = rule.index
        inputs = rule.inputs(x, y, self._noise(number, j))
        with self.autocast():
            out = full(group.forward(group.params, group.buffers, inputs))
        if j == rule.count - 1:
            return group._losses(out, y, workload, False)
        target = rule.labels[j].to(out.device)[y]
        return (out.flatten(2) - target).square().mean(dim=(1, 2))

    def batch_losses(self, batch: Any, workload: Workload) -> Tensor:
        """The members' ``[k]`` losses of every segment trained here, summed (what a step
        back-propagates; the memory probe measures what it keeps)."""
        x, y = batch
        each = [self._segment_losses(p, x, y, workload, 0) for p in range(len(self.segments))]
        return torch.stack(each).sum(dim=0)

    def outputs(self, x: Tensor) -> Tensor:
        """The composed model's outputs ``[k, B, ...]`` on a shared input."""
        assert self.only is None, "one segment is not the model"
        h = x
        for j, (group, stacked) in enumerate(zip(self.segments, self.stacked, strict=True)):
            forward = group.forward if j == 0 else stacked
            with self.autocast():
                h = forward(group.params, group.buffers, h)
        return full(h)

    def keep(self, index: list[int]) -> None:
        for group in self.segments:
            group.keep(index)
        self.keys = [self.keys[i] for i in index]
        self.params = {n: p for g in self.segments for n, p in g.params.items()}
        self.buffers = {n: b for g in self.segments for n, b in g.buffers.items()}
        self.losses.keep(index)


def decoupled_group(
    keys: list[Hashable],
    params: dict[str, Tensor],
    buffers: dict[str, Tensor],
    optimizer_states: Sequence[Mapping[str, Any] | None],
    stack: Stack,
    precision: str,
    training: TrainingSettings,
    data_seed: int,
    example: Tensor,
    build: Any,
    only: int | None = None,
) -> DecoupledGroup:
    """``keys``' stacked ``params`` and ``buffers`` as a :class:`DecoupledGroup`: cut where
    :func:`worker.decoupled.cut_points` cuts ``stack.template``; ``build(params, states)``
    makes a segment's stacked optimizer; ``example``: one input batch (for the widths);
    ``only``: the segment to train alone (None: all)."""
    subs = _segments(stack.template, training.segments)
    widths = _widths(subs, example)
    labels = [t.to(example.dtype) for t in synthetic_labels(widths[-1], widths[:-1], data_seed)]
    if only is not None and not 0 <= only < len(subs):
        raise ValueError(f"segment {only} of a model cut into {len(subs)}")
    segments, stacked = [], []
    for j, sub in enumerate(subs):
        if only is not None and j != only:
            continue  # a segment unit holds its own segment only
        own, bufs = _names(sub)
        seg_params = {n: p for n, p in params.items() if n in own}
        states = [
            None if st is None else {"step": st["step"], "state": {
                n: v for n, v in st["state"].items() if n in own}}
            for st in optimizer_states
        ]  # fmt: skip
        optimizer: StackedOptimizer = build(seg_params, states)
        seg_stack = Stack(stack_forward(sub, stack.mode, False), sub, stack.stochastic,
                          stack.mode)  # fmt: skip
        segments.append(Group(keys, seg_params, {n: b for n, b in buffers.items() if n in bufs},
                              optimizer, seg_stack, precision))  # fmt: skip
        stacked.append(stack_forward(sub, stack.mode, True))
    return DecoupledGroup(keys, segments, stacked, stack, precision, labels, training, data_seed,
                          only)  # fmt: skip
