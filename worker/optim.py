"""Optimizers over stacked parameters: one ``[k, ...]`` tensor holds k trials.

``torch.optim`` takes one learning rate per parameter group and rejects the
per-trial ``[k]`` tensors a fused array needs, so SGD, Adam, AdamW, RMSprop,
Adagrad and Adadelta are written here for stacked parameters. Each
hyperparameter is a ``[k]`` float64 tensor; per-member scalars (bias
corrections, step sizes) are computed from Python floats, like torch.optim's,
then cast to the parameter's dtype as ``[k, 1]`` tensors that broadcast over
one member's row.

The optimizer moves its parameters into one ``[k, N]`` buffer per dtype
(:mod:`worker.flat`; the tensors stay the caller's objects) and keeps its
state in buffers of the same layout. When every parameter has a gradient, a
step copies the gradients into one such buffer and updates the whole array
with a handful of ops (SGD: 2-4, Adam: 8-9), instead of that many per
parameter; otherwise each parameter with a gradient is updated on its own
columns, and those without one are left alone, as torch.optim does.

The update rules follow torch.optim's single-tensor implementations step for
step (SGD with dampening 0; Adam's L2 weight decay added to the gradient;
AdamW's decoupled decay), so each member matches its own ``torch.optim`` run
to float rounding. Nothing here reads a device tensor: a step is pure tensor work.

Per member too: a learning-rate schedule (:mod:`packtune.schedules`; the
member's ``lr`` times the factor of its own step count, recomputed each step
when any member's schedule is not constant) and gradient clipping by the
norm over all of a member's gradients (``clip_norm``, 0: off), as
``torch.nn.utils.clip_grad_norm_`` does for one model before its step.

Every member carries its own ``step`` count, so a resumed trial (step 30) and
a fresh one (step 0) can share an array. (One count per member: torch.optim's
Adam counts per parameter, which differs only where a parameter skips steps
without a gradient.) SGD's first step copies the gradient
into the momentum buffer, as torch.optim does, for members whose step is 0.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from packtune.schedules import Schedule
from packtune.workloads.base import OPTIMIZER_HYPER as OPTIMIZER_HYPER
from packtune.workloads.base import OPTIMIZERS
from worker.flat import flatten_

MemberState = dict[str, Any]
"""One member's optimizer state: ``{"step": float, "state": {param: {key: Tensor}}}``."""

#: torch's fused optimizer kernels (what ``torch.optim.SGD(fused=True)`` and Adam's call), on
#: a CPU since torch 2.4; without them every step takes the element-wise ops.
FUSED_KERNELS = all(hasattr(torch, op) for op in ("_fused_sgd_", "_fused_adam_", "_fused_adamw_"))

Slots = dict[str, Tensor]
"""State buffers by key (``exp_avg``...), ``[k, n]`` columns of the flat state."""


class Columns:
    """Per-member ``[k, 1]`` values in one dtype and device, computed once per step or array."""

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype, self.device = dtype, device
        self.cache: dict[str, Tensor] = {}

    def get(self, name: str, values: Callable[[], Sequence[float] | Tensor]) -> Tensor:
        column = self.cache.get(name)
        if column is None:
            made = values()
            column = torch.as_tensor(made, dtype=torch.float64, device=self.device)
            column = self.cache[name] = column.to(self.dtype).view(-1, 1)
        return column


class StackedOptimizer(abc.ABC):
    """Base class: stacked ``params`` (leaf tensors ``[k, ...]``) and ``[k]`` ``hyper``."""

    hyper_keys: tuple[str, ...] = ()
    state_keys: tuple[str, ...] = ()
    #: whether :meth:`_update_members` (torch's fused CPU kernels) exists for this rule
    member_kernels = False

    def __init__(
        self,
        params: Mapping[str, Tensor],
        hyper: Mapping[str, Tensor],
        states: Sequence[MemberState | None] | None = None,
        schedules: Sequence[Schedule] | None = None,
        pin: bool = False,
    ) -> None:
        first = next(iter(params.values()))
        self.pin = pin  # parameters in page-locked host memory (a spilled array's)
        k, device = first.shape[0], first.device
        missing = set(self.hyper_keys) - set(hyper)
        if missing:
            raise ValueError(f"{type(self).__name__} needs hyperparameter(s) {sorted(missing)}")
        self.hyper = {
            key: torch.as_tensor(hyper[key], dtype=torch.float64, device=device).reshape(k)
            for key in self.hyper_keys
        }
        clip = hyper.get("clip_norm")
        self.clip_norm = [0.0] * k if clip is None else [float(c) for c in torch.as_tensor(clip)]
        self.base_lr = self.hyper["lr"].tolist()
        self.schedules = list(schedules) if schedules is not None else [Schedule()] * k
        if len(self.schedules) != k:
            raise ValueError(f"{len(self.schedules)} schedules for an array of {k}")
        states = list(states) if states is not None else [None] * k
        if len(states) != k:
            raise ValueError(f"{len(states)} member states for an array of {k}")
        self.steps = [float(s["step"]) if s else 0.0 for s in states]
        self._count_on(device)
        self._place(params)
        with torch.no_grad():
            for i, s in enumerate(states):
                if s is None:
                    continue
                for name, slots in self.state.items():
                    for key, t in slots.items():
                        t[i].copy_(s["state"][name][key])

    def _count_on(self, device: torch.device) -> None:
        """Python copies of the hyperparameters, and the steps as a tensor on ``device``
        (float64 for the bias corrections on a GPU; float32, torch.optim's, for the fused
        kernels on a CPU)."""
        self.values = {key: v.tolist() for key, v in self.hyper.items()}
        self.by_member = device.type == "cpu" and FUSED_KERNELS and self.member_kernels
        self.scheduled = not all(schedule.constant for schedule in self.schedules)
        self.clipping = any(c > 0 for c in self.clip_norm)
        self.clip_column = torch.tensor(self.clip_norm, dtype=torch.float64, device=device)
        dtype = torch.float32 if self.by_member else torch.float64
        self.step_tensor = torch.tensor(self.steps, dtype=dtype, device=device)
        self.step_rows = list(self.step_tensor.unbind(0))

    def _place(self, params: Mapping[str, Tensor], flat_state: list[Slots] | None = None) -> None:
        """Flatten ``params`` and view ``flat_state`` (zeros if ``None``) per parameter."""
        self.params = dict(params)
        self.stacks = flatten_(self.params, self.pin)
        self.flat_state = flat_state or [
            {key: stack.zeros() for key in self.state_keys} for stack, _ in self.stacks
        ]
        self.grads = [stack.empty() for stack, _ in self.stacks]
        self.rows = [  # member i's row of every buffer, for the fused kernels
            [(buffer[i], grads[i], {key: t[i] for key, t in slots.items()}) for i in range(stack.k)]
            for (stack, buffer), grads, slots in zip(
                self.stacks, self.grads, self.flat_state, strict=True
            )
        ]
        self.state: dict[str, Slots] = {}
        for (stack, _), slots in zip(self.stacks, self.flat_state, strict=True):
            for j, name in enumerate(stack.names):
                self.state[name] = {key: stack.view(t, j) for key, t in slots.items()}
        self.constants = {
            (stack.dtype, stack.device): Columns(stack.dtype, stack.device)
            for stack, _ in self.stacks
        }  # casts of the hyperparameters
        wd = self.hyper.get("weight_decay")
        self.decay = wd is not None and bool((wd != 0).any())  # else decay steps are skipped

    @property
    def size(self) -> int:
        return len(self.steps)

    def zero_grad(self) -> None:
        for p in self.params.values():
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        """One update of every member that has a gradient."""
        if self.scheduled:
            self._schedule()
        self.steps = [s + 1 for s in self.steps]
        self.step_tensor += 1
        # every stack's gradients first (one flat buffer each where all are present; else
        # per parameter), so that clipping sees a member's whole gradient
        gathered: list[Tensor | list[Tensor | None]] = []
        for (stack, _), grads in zip(self.stacks, self.grads, strict=True):
            given = [self.params[name].grad for name in stack.names]
            present = [g for g in given if g is not None]
            if len(present) == len(given):
                gathered.append(stack.pack(present, grads))
            else:  # torch.optim skips parameters without a gradient
                gathered.append(
                    [None if g is None else g.reshape(stack.k, -1).clone() for g in given]
                )
        if self.clipping:
            self._clip(gathered)
        for (stack, buffer), grad, slots, rows in zip(
            self.stacks, gathered, self.flat_state, self.rows, strict=True
        ):
            const = self.constants[stack.dtype, stack.device]
            per_step = Columns(stack.dtype, stack.device)
            if isinstance(grad, Tensor):
                if self.by_member:
                    self._update_members(rows)
                else:
                    self._update(buffer, grad, slots, const, per_step)
                continue
            for cols, g in zip(stack.spans, grad, strict=True):
                if g is not None:
                    self._update(
                        buffer[:, cols],
                        g,
                        {key: t[:, cols] for key, t in slots.items()},
                        const,
                        per_step,
                    )

    def _schedule(self) -> None:
        """Every member's learning rate for this step: its base ``lr`` times its schedule's
        factor at its own step count (the columns that depend on it are per step)."""
        lr = [
            base * schedule.factor(int(step))
            for base, schedule, step in zip(self.base_lr, self.schedules, self.steps, strict=True)
        ]
        self.values["lr"] = lr
        self.hyper["lr"] = torch.tensor(lr, dtype=torch.float64).to(
            self.hyper["lr"].device, non_blocking=True
        )

    def _clip(self, gathered: Sequence[Tensor | list[Tensor | None]]) -> None:
        """Scale each member's gradients so that their norm (over every parameter) is at most
        its ``clip_norm``, as ``torch.nn.utils.clip_grad_norm_`` (a 0 leaves it alone)."""
        squares = []
        for grad in gathered:
            parts = [grad] if isinstance(grad, Tensor) else [g for g in grad if g is not None]
            squares += [g.double().square().sum(dim=1) for g in parts]
        if not squares:
            return
        norm = torch.stack(squares).sum(dim=0).sqrt()
        clip = self.clip_column
        coef = torch.where(clip > 0, (clip / (norm + 1e-6)).clamp(max=1.0), 1.0)
        for grad in gathered:
            parts = [grad] if isinstance(grad, Tensor) else [g for g in grad if g is not None]
            for g in parts:
                g.mul_(coef.to(g.dtype).view(-1, 1))

    def _lr(
        self, const: Columns, per_step: Columns, name: str, values: Callable[[], Any]
    ) -> Tensor:
        """A column computed from ``lr``: for the array's life, or per step when scheduled."""
        return (per_step if self.scheduled else const).get(name, values)

    def _update_members(self, rows: list[tuple[Tensor, Tensor, Slots]]) -> None:
        """Update each member's row ``(param, grad, state)`` with torch's fused CPU kernel:
        one pass over the row's memory where the ops of :meth:`_update` make several
        (only where :attr:`member_kernels` says the rule has one)."""
        raise NotImplementedError(f"{type(self).__name__} has no fused CPU kernel")

    def _l2(self, p: Tensor, grad: Tensor, const: Columns) -> None:
        """torch.optim's L2 weight decay: ``grad += weight_decay * p`` (skipped when every
        member's is 0: adding 0 * p would change nothing)."""
        if self.decay:
            grad.addcmul_(p, const.get("wd", lambda: self.hyper["weight_decay"]))

    @abc.abstractmethod
    def _update(
        self, p: Tensor, grad: Tensor, state: Slots, const: Columns, per_step: Columns
    ) -> None:
        """Update ``p`` (``[k, n]`` columns, in place) from ``grad`` (the same shape, scratch:
        it may be overwritten) and its ``state`` columns; ``self.steps`` counts this step.
        ``const`` caches hyperparameter columns for the array's life, ``per_step`` for this step.
        """

    def member_state(self, i: int) -> MemberState:
        """Member ``i``'s state, detached and copied to the CPU (for checkpoints)."""
        return {
            "step": self.steps[i],
            "state": {
                name: {key: t[i].detach().to("cpu", copy=True) for key, t in slots.items()}
                for name, slots in self.state.items()
            },
        }

    def select(self, keep: Sequence[int], params: Mapping[str, Tensor]) -> None:
        """Keep members ``keep`` (in that order); ``params`` are the array's new leaves."""
        index = torch.as_tensor(list(keep), dtype=torch.long, device=self.hyper["lr"].device)
        self.hyper = {key: v[index] for key, v in self.hyper.items()}
        self.base_lr = [self.base_lr[i] for i in keep]
        self.schedules = [self.schedules[i] for i in keep]
        self.clip_norm = [self.clip_norm[i] for i in keep]
        self.steps = [self.steps[i] for i in keep]
        self._count_on(index.device)
        flat_state = [{key: t[index] for key, t in slots.items()} for slots in self.flat_state]
        self._place(params, flat_state)


class StackedSGD(StackedOptimizer):
    """``torch.optim.SGD`` with dampening 0, per-member lr, momentum and weight decay."""

    hyper_keys = ("lr", "momentum", "weight_decay")
    state_keys = ("momentum_buffer",)
    member_kernels = True

    def __init__(self, *args: Any, nesterov: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.nesterov = nesterov

    def _update(
        self, p: Tensor, grad: Tensor, state: Slots, const: Columns, per_step: Columns
    ) -> None:
        h = self.hyper
        momentum = const.get("momentum", lambda: h["momentum"])
        if min(self.steps) <= 1:
            # torch.optim starts the buffer as a copy of the first gradient: with the
            # buffer at zero, scaling it by 0 on a member's first step gives exactly that.
            started = [
                m if s > 1 else 0.0
                for m, s in zip(self.values["momentum"], self.steps, strict=True)
            ]
            momentum_now = per_step.get("started", lambda: started)
        else:
            momentum_now = momentum
        if self.decay:  # adding 0 * p would change nothing: skip it when every wd is 0
            grad.addcmul_(p, const.get("wd", lambda: h["weight_decay"]))
        buf = state["momentum_buffer"]
        torch.addcmul(grad, buf, momentum_now, out=buf)  # buf * momentum + grad
        if self.nesterov:
            update = grad.addcmul_(buf, momentum)
        else:
            update = buf
        p.addcmul_(update, self._lr(const, per_step, "-lr", lambda: -h["lr"]))

    def _update_members(self, rows: list[tuple[Tensor, Tensor, Slots]]) -> None:
        lr, momentum, wd = (self.values[key] for key in ("lr", "momentum", "weight_decay"))
        for i, (p, grad, state) in enumerate(rows):
            # a zero buffer scaled by the momentum plus the gradient is the gradient: no
            # first-step case needed (torch.optim's copy); without momentum, no buffer
            buffers = [state["momentum_buffer"]] if momentum[i] else []
            torch._fused_sgd_(
                [p], [grad], buffers, weight_decay=wd[i],
                momentum=momentum[i], lr=lr[i], dampening=0.0, nesterov=self.nesterov,
                maximize=False, is_first_step=False,
            )  # fmt: skip


class StackedAdam(StackedOptimizer):
    """``torch.optim.Adam`` (L2 weight decay) or, with ``decoupled``, ``torch.optim.AdamW``."""

    hyper_keys = ("lr", "beta1", "beta2", "eps", "weight_decay")
    state_keys = ("exp_avg", "exp_avg_sq")
    member_kernels = True

    def __init__(self, *args: Any, decoupled: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.decoupled = decoupled

    def _update(
        self, p: Tensor, grad: Tensor, state: Slots, const: Columns, per_step: Columns
    ) -> None:
        h = self.hyper
        if self.decoupled:
            if self.decay:  # multiplying by 1 - lr * 0 would change nothing
                p.mul_(
                    self._lr(const, per_step, "1-lr*wd", lambda: 1 - h["lr"] * h["weight_decay"])
                )
        elif self.decay:
            grad.addcmul_(p, const.get("wd", lambda: h["weight_decay"]))
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.lerp_(grad, const.get("1-beta1", lambda: 1 - h["beta1"]))
        # exp_avg_sq * beta2 + (1 - beta2) * grad * grad, as torch.optim rounds it
        square = grad.mul_(grad * const.get("1-beta2", lambda: 1 - h["beta2"]))
        torch.addcmul(square, exp_avg_sq, const.get("beta2", lambda: h["beta2"]), out=exp_avg_sq)
        bc2_sqrt, neg_step_size = self._bias_corrections(per_step)
        denom = exp_avg_sq.sqrt().div_(bc2_sqrt).add_(const.get("eps", lambda: h["eps"]))
        p.addcmul_(torch.div(exp_avg, denom, out=denom), neg_step_size)

    def _update_members(self, rows: list[tuple[Tensor, Tensor, Slots]]) -> None:
        kernel = torch._fused_adamw_ if self.decoupled else torch._fused_adam_
        v = self.values
        for i, (p, grad, state) in enumerate(rows):
            kernel(
                [p], [grad], [state["exp_avg"]], [state["exp_avg_sq"]], [], [self.step_rows[i]],
                lr=v["lr"][i], beta1=v["beta1"][i], beta2=v["beta2"][i],
                weight_decay=v["weight_decay"][i], eps=v["eps"][i], amsgrad=False,
                maximize=False,
            )  # fmt: skip

    def _bias_corrections(self, per_step: Columns) -> tuple[Tensor, Tensor]:
        """Per member: ``sqrt(1 - beta2**step)`` and ``-lr / (1 - beta1**step)``.

        On a CPU in Python floats, as torch.optim computes them; elsewhere as
        float64 ops on the device (a Python value would be copied to it each step).
        """
        if self.step_tensor.device.type == "cpu":
            lr, beta1, beta2 = (self.values[key] for key in ("lr", "beta1", "beta2"))
            bc2 = [(1 - b**s) ** 0.5 for b, s in zip(beta2, self.steps, strict=True)]
            nss = [-(a / (1 - b**s)) for a, b, s in zip(lr, beta1, self.steps, strict=True)]
            return per_step.get("bc2", lambda: bc2), per_step.get("-step_size", lambda: nss)
        h, steps = self.hyper, self.step_tensor
        return (
            per_step.get("bc2", lambda: (1 - h["beta2"] ** steps).sqrt()),
            per_step.get("-step_size", lambda: -(h["lr"] / (1 - h["beta1"] ** steps))),
        )


class StackedRMSprop(StackedOptimizer):
    """``torch.optim.RMSprop`` (not centered), per-member lr, alpha, eps, weight decay and
    momentum (a member with momentum 0 updates as torch.optim's plain rule)."""

    hyper_keys = ("lr", "alpha", "eps", "weight_decay", "momentum")
    state_keys = ("square_avg", "momentum_buffer")

    def _update(
        self, p: Tensor, grad: Tensor, state: Slots, const: Columns, per_step: Columns
    ) -> None:
        h = self.hyper
        self._l2(p, grad, const)
        square_avg, buf = state["square_avg"], state["momentum_buffer"]
        square_avg.mul_(const.get("alpha", lambda: h["alpha"]))
        square_avg.addcmul_(grad, grad * const.get("1-alpha", lambda: 1 - h["alpha"]))
        avg = square_avg.sqrt().add_(const.get("eps", lambda: h["eps"]))
        buf.mul_(const.get("momentum", lambda: h["momentum"])).addcdiv_(grad, avg)
        p.addcmul_(buf, self._lr(const, per_step, "-lr", lambda: -h["lr"]))


class StackedAdagrad(StackedOptimizer):
    """``torch.optim.Adagrad`` (no lr decay, accumulator starting at 0), per-member lr, eps
    and weight decay. (torch.optim's default eps is 1e-10; packtune's shared ``eps`` default
    is 1e-8: set it in the space to match.)"""

    hyper_keys = ("lr", "eps", "weight_decay")
    state_keys = ("sum",)

    def _update(
        self, p: Tensor, grad: Tensor, state: Slots, const: Columns, per_step: Columns
    ) -> None:
        h = self.hyper
        self._l2(p, grad, const)
        total = state["sum"]
        total.addcmul_(grad, grad)
        std = total.sqrt().add_(const.get("eps", lambda: h["eps"]))
        p.addcmul_(grad.div_(std), self._lr(const, per_step, "-lr", lambda: -h["lr"]))


class StackedAdadelta(StackedOptimizer):
    """``torch.optim.Adadelta``, per-member lr, rho, eps and weight decay."""

    hyper_keys = ("lr", "rho", "eps", "weight_decay")
    state_keys = ("square_avg", "acc_delta")

    def _update(
        self, p: Tensor, grad: Tensor, state: Slots, const: Columns, per_step: Columns
    ) -> None:
        h = self.hyper
        self._l2(p, grad, const)
        rho, eps = const.get("rho", lambda: h["rho"]), const.get("eps", lambda: h["eps"])
        one_minus_rho = const.get("1-rho", lambda: 1 - h["rho"])
        square_avg, acc_delta = state["square_avg"], state["acc_delta"]
        square_avg.mul_(rho).addcmul_(grad, grad * one_minus_rho)
        std = square_avg.add(eps).sqrt_()
        delta = acc_delta.add(eps).sqrt_().div_(std).mul_(grad)
        acc_delta.mul_(rho).addcmul_(delta, delta * one_minus_rho)
        p.addcmul_(delta, self._lr(const, per_step, "-lr", lambda: -h["lr"]))


def build_optimizer(
    name: str,
    params: Mapping[str, Tensor],
    hyper: Mapping[str, Tensor],
    *,
    nesterov: bool = False,
    states: Sequence[MemberState | None] | None = None,
    schedules: Sequence[Schedule] | None = None,
    pin: bool = False,
) -> StackedOptimizer:
    """The stacked optimizer called ``name`` (one of :data:`OPTIMIZERS`).

    ``hyper`` values should be float64 (or Python floats): a float32 tensor
    has already rounded ``lr=0.1`` to 0.10000000149. ``hyper["clip_norm"]``,
    when given, clips each member's gradient norm (0: not that member).
    ``states`` optionally gives each member's exported state (``None`` for a
    fresh member), so an array can resume trials that trained elsewhere.
    ``schedules`` gives each member's learning-rate schedule (constant if omitted).
    ``params`` are moved into the optimizer's flat buffers (:mod:`worker.flat`), page-locked
    with ``pin`` (host parameters of a spilled array on a GPU).
    """
    kwargs: dict[str, Any] = {"states": states, "schedules": schedules, "pin": pin}
    if name == "sgd":
        return StackedSGD(params, hyper, nesterov=nesterov, **kwargs)
    if name in ("adam", "adamw"):
        return StackedAdam(params, hyper, decoupled=name == "adamw", **kwargs)
    rules: dict[str, type[StackedOptimizer]] = {
        "rmsprop": StackedRMSprop,
        "adagrad": StackedAdagrad,
        "adadelta": StackedAdadelta,
    }
    if name in rules:
        return rules[name](params, hyper, **kwargs)
    raise ValueError(f"unknown optimizer {name!r}; expected one of {', '.join(OPTIMIZERS)}")
