"""One stack of members trained together: forward, per-member losses, backward, update.

A fused array holds one :class:`Group` (all members, ``bmm`` or ``vmap``) or
one per member (``serial``). A step's per-member losses are recorded for
the epoch's train loss and for divergence: on a CPU by reading them (free
there) into Python floats; on a GPU with device ops only, so that the host
can queue the next steps while the device works.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass
from typing import cast

import torch
from torch import Tensor, nn
from torch.func import vmap

from packtune.tuning import LOOP_LOSS_MAX
from packtune.workloads.base import Workload
from worker.fused_forward import Forward
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

    def keep(self, index: list[int]) -> None:
        idx = torch.tensor(index, dtype=torch.long, device=self.sums.device)
        self.sums, self.bad = self.sums[idx], self.bad[idx]


@dataclass(frozen=True)
class Stack:
    """How a group runs: ``forward`` over the stacked tensors with ``template`` (the
    meta-device module whose train/eval mode is the stack's), whether training draws random
    numbers, and the forward's name (``bmm``, ``vmap`` or ``serial``)."""

    forward: Forward
    template: nn.Module
    stochastic: bool
    mode: str


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
    ) -> None:
        self.keys, self.params, self.buffers = keys, params, buffers
        self.optimizer, self.forward = optimizer, stack.forward
        self.template, self.stochastic, self.mode = stack.template, stack.stochastic, stack.mode
        device = next(iter(params.values())).device
        self.on_host = device.type == "cpu"
        self.losses = HostLosses(len(keys)) if self.on_host else DeviceLosses(len(keys), device)

    def step(self, x: Tensor, y: Tensor, workload: Workload, number: int) -> None:
        """Optimizer step ``number`` on the batch, recording the members' losses."""
        out = self.forward(self.params, self.buffers, x)
        losses = self._losses(out, y, workload)
        losses.sum().backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.losses.record(losses.detach(), number)

    def _losses(self, out: Tensor, y: Tensor, workload: Workload) -> Tensor:
        """The members' ``[k]`` losses: the workload's batched form where it has one."""
        k, loss = len(self.keys), workload.loss
        if k == 1:
            return loss(out[0], y).unsqueeze(0)
        stacked = workload.stacked_loss(out, y)
        if stacked is not None:
            return stacked
        if k <= LOOP_LOSS_MAX and self.on_host:
            # unbind: one autograd node whose backward stacks the k gradients, where
            # k selections would each scatter into a zero [k, B, ...] tensor to be summed
            return torch.stack([loss(o, y) for o in out.unbind(0)])
        return cast(Tensor, vmap(loss, in_dims=(0, None))(out, y))

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
