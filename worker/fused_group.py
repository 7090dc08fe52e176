"""One stack of members trained together: forward, per-member losses, backward, update.

A fused array holds one :class:`Group` (all members, ``bmm`` or ``vmap``) or
one per member (``serial``). A step's batch is ``(x, y)``, shared by the members or, for
a workload with per-member batches, stacked ``[k, ...]``; a workload with its own step
(``training_loss``) takes any batch. With ``precision: bf16`` the forward pass runs under
``torch.autocast`` to bfloat16 (the loss in float32 on its outputs); the stacked weights,
their gradients and the optimizer stay float32. A step's per-member losses are recorded for
the epoch's train loss and for divergence: on a CPU by reading them (free
there) into Python floats; on a GPU with device ops only, so that the host
can queue the next steps while the device works.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Hashable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.func import vmap

from packtune.tuning import LOOP_LOSS_MAX
from packtune.workloads.base import Workload
from worker.batches import batch_size, tensors
from worker.fused_forward import Forward, Losses, MemberStreams, model_function
from worker.model_rules import recomputed_error
from worker.optim import StackedOptimizer


class HostLosses:
    """Per-member step losses read into Python floats (a CPU: reading costs nothing)."""

    def __init__(self, k: int) -> None:
        self.sums, self.bad = [0.0] * k, [0] * k  # bad: first non-finite step, or 0

    def record(self, losses: Tensor, number: int) -> None:
        values = losses.tolist()
        self.sums = [total + v for total, v in zip(self.sums, values, strict=True)]
        if not all(map(math.isfinite, values)):
            self.bad = [
                bad or (0 if math.isfinite(v) else number)
                for bad, v in zip(self.bad, values, strict=True)
            ]

    def bad_steps(self) -> list[int]:
        return list(self.bad)

    def totals(self) -> list[float]:
        return list(self.sums)

    def reset(self) -> None:
        self.sums = [0.0] * len(self.sums)

    def carry(self, i: int, total: float, bad: int = 0) -> None:
        """Member ``i``'s sum so far this epoch (and its first non-finite step, or 0), from
        a checkpoint taken in the middle of it or from the group it was split from."""
        self.sums[i], self.bad[i] = total, bad

    def keep(self, index: list[int]) -> None:
        self.sums, self.bad = [self.sums[i] for i in index], [self.bad[i] for i in index]


class DeviceLosses:
    """Per-member step losses kept on the device: recording never waits for it."""

    def __init__(self, k: int, device: torch.device) -> None:
        self.sums = torch.zeros(k, dtype=torch.float64, device=device)
        self.bad = torch.zeros(k, dtype=torch.long, device=device)

    def record(self, losses: Tensor, number: int) -> None:
        self.sums += losses
        first = ~torch.isfinite(losses) & (self.bad == 0)
        self.bad = torch.where(first, number, self.bad)

    def bad_steps(self) -> list[int]:
        return cast(list[int], self.bad.tolist())

    def totals(self) -> list[float]:
        return cast(list[float], self.sums.tolist())

    def reset(self) -> None:
        self.sums.zero_()

    def carry(self, i: int, total: float, bad: int = 0) -> None:
        """Member ``i``'s sum so far this epoch (and its first non-finite step, or 0), from
        a checkpoint taken in the middle of it or from the group it was split from."""
        self.sums[i], self.bad[i] = total, bad

    def keep(self, index: list[int]) -> None:
        idx = torch.tensor(index, dtype=torch.long, device=self.sums.device)
        self.sums, self.bad = self.sums[idx], self.bad[idx]


@dataclass(frozen=True)
class Stack:
    """How a group runs: ``forward`` over the stacked tensors with ``template`` (the
    meta-device module whose train/eval mode is the stack's), whether training draws random
    numbers, and the forward's name (``bmm``, ``vmap`` or ``serial``).

    ``forward`` takes the shared batch (evaluation, and training unless ``stacked``);
    ``stacked``: training batches are the members' own, ``[k, ...]``, run by
    ``train_forward``; ``losses``: a workload's own step (``training_loss``), in place of
    forward and loss when training.
    """

    forward: Forward
    template: nn.Module
    stochastic: bool
    mode: str
    stacked: bool = False
    train_forward: Forward | None = None
    losses: Losses | None = None
    #: each member's own dropout stream (``bmm``/``serial`` stacks of a model whose only
    #: draws are its Dropout modules'), seeded before each step
    streams: MemberStreams | None = None


def metric_values(workload: Workload, method: str, values: Any) -> dict[str, float]:
    """What a workload's ``metrics()`` (or ``validation_metrics()``) returned, as numbers: a
    Python number, a one-element tensor or a NumPy scalar each becomes a float; anything
    else is an error naming the method and the metric (a trial's fault: its trials fail at
    their first measurement, rather than every write of them failing in the database)."""
    if not isinstance(values, Mapping):
        raise TypeError(
            f"{workload.name}.{method}() returned {type(values).__name__}; it must return a "
            "dict of metric name -> number"
        )
    out: dict[str, float] = {}
    for name, value in values.items():
        if not isinstance(name, str):
            raise TypeError(
                f"{workload.name}.{method}() returned a metric named {name!r} "
                f"({type(name).__name__}); metric names are strings"
            )
        try:
            if isinstance(value, str | bytes):  # float("0.5") reads a string as a number
                raise TypeError
            out[name] = float(value)
        except (TypeError, ValueError, RuntimeError):
            shape = f" of shape {tuple(value.shape)}" if isinstance(value, Tensor) else ""
            raise TypeError(
                f"{workload.name}.{method}() returned {name}={type(value).__name__}{shape}; "
                "a metric must be a number (a float, or a tensor of one element)"
            ) from None
    return out


def full(t: Tensor) -> Tensor:
    """``t`` in float32 if autocast made it a half type (loss and metrics in float32)."""
    return t.float() if t.dtype in (torch.bfloat16, torch.float16) else t


def autocast(precision: str, device: torch.device) -> AbstractContextManager[Any]:
    """The context a forward pass runs in at ``precision`` (``fp32``: none)."""
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return nullcontext()


def shapes(batch: Any) -> Hashable:
    """The shapes of ``batch``'s tensors, in order (what a compiled step specialises on)."""
    return tuple(tuple(t.shape) for t in tensors(batch))


@functools.cache
def written_for_loss(cls: type, method: str) -> bool:
    """Whether ``cls``'s ``method`` was written for its ``loss``: in the class that defines
    that ``loss`` or below it, not above a ``loss`` a subclass overrides. A user's subclass
    of a classification workload that overrides ``loss`` alone (label smoothing) trained by
    the inherited batched cross-entropy (``stacked_loss``), fused and alone alike, and was
    measured by the cross-entropy the inherited ``metrics`` return as ``val_loss``."""
    loss = next(c for c in cls.__mro__ if "loss" in vars(c))
    other = next(c for c in cls.__mro__ if method in vars(c))
    return issubclass(other, loss)


def validation_values(workload: Workload, out: Tensor, y: Tensor) -> dict[str, float]:
    """``val_loss`` (``loss``) and the metrics of one model's validation outputs; a
    ``val_loss`` among the metrics wins where ``metrics`` was written for that ``loss``."""
    values = metric_values(workload, "metrics", workload.metrics(out, y))
    if not written_for_loss(type(workload), "metrics"):
        values.pop("val_loss", None)
    return {"val_loss": float(workload.loss(out, y)), **values}


def member_losses(
    out: Tensor, y: Tensor, workload: Workload, stacked: bool, on_host: bool, batched: bool
) -> Tensor:
    """The members' ``[k]`` losses from their outputs ``out`` (``[k, B, ...]``, float32): the
    workload's batched form where it has one, for one member too (a member's loss must not
    depend on how many share its array: ``F.cross_entropy``'s mean and the batched form's
    per-example mean round apart in the last bits); ``stacked``: each member's targets are
    its own (``y[i]``); ``batched``: its ``stacked_loss`` was written for its ``loss``
    (:func:`written_for_loss`, asked outside a compiled step)."""
    k, loss = out.shape[0], workload.loss
    if stacked:
        return torch.stack([loss(o, t) for o, t in zip(out.unbind(0), y.unbind(0), strict=True)])
    losses = workload.stacked_loss(out, y) if batched else None
    if losses is not None:
        return losses
    if k == 1:
        return loss(out[0], y).unsqueeze(0)
    if k <= LOOP_LOSS_MAX and on_host:
        # unbind: one autograd node whose backward stacks the k gradients, where
        # k selections would each scatter into a zero [k, B, ...] tensor to be summed
        return torch.stack([loss(o, y) for o in out.unbind(0)])
    return cast(Tensor, vmap(loss, in_dims=(0, None))(out, y))


def losses_function(
    stack: Stack, workload: Workload, precision: str, device: torch.device
) -> Losses:
    """``(params, buffers, batch) -> [k]``: the training losses of ``stack``'s members on a
    batch (float32, not bf16; autograd), the function a compiled step compiles."""
    on_host = device.type == "cpu"
    batched = written_for_loss(type(workload), "stacked_loss")

    def losses(params: dict[str, Tensor], buffers: dict[str, Tensor], batch: Any) -> Tensor:
        if stack.losses is not None:
            with autocast(precision, device):
                return full(stack.losses(params, buffers, batch))
        x, y = batch
        forward = stack.train_forward or stack.forward
        with autocast(precision, device):
            out = forward(params, buffers, x)
        return member_losses(full(out), y, workload, stack.stacked, on_host, batched)

    return losses


def backward(losses: Tensor, name: str) -> None:
    """The backward pass of the members' summed training ``losses`` (workload ``name``'s):
    one that ran the forward again (``torch.utils.checkpoint``) is an error saying so."""
    try:
        losses.sum().backward()
    except RuntimeError as exc:
        clear = recomputed_error(name, exc)
        if clear is None:
            raise
        raise clear from exc


class Group:
    """Members trained as one stack: all of an array's (fused) or one (serial).

    ``losses`` records each member's summed step losses (for the epoch's train
    loss) and the first step whose loss was not finite (for divergence).
    """

    def __init__(
        self,
        keys: list[Hashable],
        params: dict[str, Tensor],
        buffers: dict[str, Tensor],
        optimizer: StackedOptimizer,
        stack: Stack,
        precision: str = "fp32",
    ) -> None:
        self.keys, self.params, self.buffers = keys, params, buffers
        self.optimizer, self.forward, self.stack = optimizer, stack.forward, stack
        self.template, self.stochastic, self.mode = stack.template, stack.stochastic, stack.mode
        self.precision = precision
        self.device = next(iter(params.values())).device
        self.on_host = self.device.type == "cpu"
        self.losses = (
            HostLosses(len(keys)) if self.on_host else DeviceLosses(len(keys), self.device)
        )
        #: whether a training step has run: a vmap stack that fails its first step is
        #: trained one member at a time instead (see ``FusedArray``)
        self.proven = self.mode != "vmap"
        #: whether an evaluation has run: a vmap stack whose first one fails (code only eval
        #: mode runs) is evaluated, and trained, one member at a time instead (``FusedArray``)
        self.eval_proven = self.mode != "vmap"
        #: the compiled losses (forward, loss; its backward compiled with it), or None: eager
        self.compiled: Losses | None = None
        self._eager: Losses | None = None  # the eager losses, made at the first step
        #: the batch shapes a compiled step has run at the current array size (guarded before)
        self.compiled_shapes: set[Hashable] = set()

    def autocast(self) -> AbstractContextManager[Any]:
        return autocast(self.precision, self.device)

    def step(self, batch: Any, workload: Workload, number: int) -> None:
        """Optimizer step ``number`` on ``batch``, recording the members' losses. A loss of
        one number per member in another shape (``[k, 1]``: a ``training_loss`` reduced to
        ``[1]``) is taken as ``[k]`` before anything changes; any other shape raises then."""
        losses = self.batch_losses(batch, workload)
        k = len(self.keys)
        if losses.shape != (k,):
            if losses.numel() != k:
                raise ValueError(
                    f"{workload.name}: a training loss must be one number per trial; got "
                    f"shape {tuple(losses.shape)} for {k} trial{'s' if k > 1 else ''}"
                )
            losses = losses.reshape(k)
        backward(losses, workload.name)
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.losses.record(losses.detach(), number)
        self.proven = True

    def batch_losses(self, batch: Any, workload: Workload) -> Tensor:
        """The members' ``[k]`` losses on a training ``batch`` (float32, not bf16; autograd):
        through the compiled step where the group has one (:mod:`worker.compiled`)."""
        if self.compiled is not None:
            return self.compiled(self.params, self.buffers, batch)
        if self._eager is None:
            self._eager = losses_function(self.stack, workload, self.precision, self.device)
        return self._eager(self.params, self.buffers, batch)

    def _losses(self, out: Tensor, y: Tensor, workload: Workload, stacked: bool) -> Tensor:
        batched = written_for_loss(type(workload), "stacked_loss")
        return member_losses(out, y, workload, stacked, self.on_host, batched)

    def settled(self, batch: Any) -> bool:
        """Whether a step on ``batch`` runs code that has run before: a vmap stack's first
        step may fail (vmap cannot batch the code), and so may a compiled step's first one
        at each batch shape (a compilation): the caller guards those."""
        return self.proven and (self.compiled is None or shapes(batch) in self.compiled_shapes)

    def outputs(self, x: Tensor) -> Tensor:
        """The members' outputs ``[k, B, ...]`` on a shared input (float32, not bf16)."""
        with self.autocast():
            return full(self.forward(self.params, self.buffers, x))

    def batch_metrics(self, batch: Any, workload: Workload) -> list[dict[str, float]]:
        """Each member's ``val_loss`` and metrics on one validation ``batch``, each value
        multiplied by the batch's size (so that summing over batches and dividing by the
        examples gives means)."""
        size = batch_size(batch)
        if not workload.custom_step:
            x, y = batch
            per_member = []
            for o in self.outputs(x).unbind(0):
                values = validation_values(workload, o, y)
                per_member.append({key: v * size for key, v in values.items()})
            return per_member
        per_member = []
        with self.autocast():
            for i in range(len(self.keys)):  # evaluation: one member at a time, any code
                params = {n: p[i] for n, p in self.params.items()}
                buffers = {n: b[i] for n, b in self.buffers.items()}
                values = metric_values(
                    workload, "validation_metrics",
                    workload.validation_metrics(model_function(self.template, params, buffers),
                                                batch),
                )  # fmt: skip
                per_member.append({key: v * size for key, v in values.items()})
        return per_member

    def keep(self, index: list[int]) -> None:
        """Keep members ``index`` (dropping the others' slices everywhere)."""
        device = next(iter(self.params.values())).device
        idx = torch.tensor(index, dtype=torch.long, device=device)
        self.keys = [self.keys[i] for i in index]
        self.params = {
            n: p.detach()[idx].requires_grad_(p.requires_grad) for n, p in self.params.items()
        }
        self.buffers = {n: b[idx] for n, b in self.buffers.items()}
        self.optimizer.select(index, self.params)
        self.losses.keep(index)
        self.compiled_shapes.clear()  # another array size: the next step may compile
