"""Optimizers over stacked parameters: one ``[k, ...]`` tensor holds k trials.

``torch.optim`` takes one learning rate per parameter group and rejects the
per-trial ``[k]`` tensors a fused array needs, so SGD, Adam and AdamW are
written here for stacked parameters. Each hyperparameter is a ``[k]`` float64
tensor; per-member scalars (bias corrections, step sizes) are computed in
float64, like torch.optim's Python floats, then cast to the parameter's dtype
and viewed as ``[k, 1, ...]`` so they broadcast over one member's slice.

The update rules follow torch.optim's single-tensor implementations step for
step (SGD with dampening 0; Adam's L2 weight decay added to the gradient;
AdamW's decoupled decay), so each member matches its own ``torch.optim`` run
to float rounding. Nothing here calls ``.item()``: a step is pure tensor work.

Every member carries its own ``step`` count, so a resumed trial (step 30) and
a fresh one (step 0) can share an array. SGD's first step copies the gradient
into the momentum buffer, as torch.optim does, for members whose step is 0.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

OPTIMIZER_HYPER = ("lr", "momentum", "weight_decay", "beta1", "beta2", "eps")
"""The fusible optimizer hyperparameters: per-trial ``[k]`` tensors in an array."""

MemberState = dict[str, Any]
"""One member's optimizer state: ``{"step": float, "state": {param: {key: Tensor}}}``."""


def _per_member(values: Tensor, like: Tensor) -> Tensor:
    """``[k]`` values as ``[k, 1, ...]`` in ``like``'s dtype, to broadcast over ``like``."""
    return values.to(like.dtype).view(-1, *([1] * (like.dim() - 1)))


Views = dict[tuple[str, int, torch.dtype], Tensor]


def _view(cache: Views, name: str, make: Callable[[], Tensor], like: Tensor) -> Tensor:
    """``_per_member(make(), like)``, computed once per (name, dim, dtype) in ``cache``.

    A step casts each per-member value once per parameter shape class instead of
    once per parameter: on a GPU every cast is a kernel launch.
    """
    key = (name, like.dim(), like.dtype)
    view = cache.get(key)
    if view is None:
        view = cache[key] = _per_member(make(), like)
    return view


class StackedOptimizer(abc.ABC):
    """Base class: stacked ``params`` (leaf tensors ``[k, ...]``) and ``[k]`` ``hyper``."""

    hyper_keys: tuple[str, ...] = ()
    state_keys: tuple[str, ...] = ()

    def __init__(
        self,
        params: Mapping[str, Tensor],
        hyper: Mapping[str, Tensor],
        states: Sequence[MemberState | None] | None = None,
    ) -> None:
        self.params = dict(params)
        first = next(iter(self.params.values()))
        k, device = first.shape[0], first.device
        missing = set(self.hyper_keys) - set(hyper)
        if missing:
            raise ValueError(f"{type(self).__name__} needs hyperparameter(s) {sorted(missing)}")
        self.hyper = {
            key: torch.as_tensor(hyper[key], dtype=torch.float64, device=device).reshape(k)
            for key in self.hyper_keys
        }
        states = list(states) if states is not None else [None] * k
        if len(states) != k:
            raise ValueError(f"{len(states)} member states for an array of {k}")
        self.step_count = torch.tensor(
            [float(s["step"]) if s else 0.0 for s in states], dtype=torch.float64, device=device
        )
        self.constants: Views = {}  # casts of the hyperparameters, until select()
        wd = self.hyper.get("weight_decay")
        self.decay = wd is not None and bool((wd != 0).any())  # else decay steps are skipped
        self.state: dict[str, dict[str, Tensor]] = {}
        for name, p in self.params.items():
            slots = {}
            for key in self.state_keys:
                slices = [
                    s["state"][name][key].to(p.device, p.dtype) if s else torch.zeros_like(p[0])
                    for s in states
                ]
                slots[key] = torch.stack(slices).detach()
            self.state[name] = slots

    @property
    def size(self) -> int:
        return int(self.step_count.shape[0])

    def zero_grad(self) -> None:
        for p in self.params.values():
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        """One update of every member that has a gradient."""
        self.step_count += 1
        self._update()

    @abc.abstractmethod
    def _update(self) -> None:
        """Apply one step; ``self.step_count`` already counts it."""

    def member_state(self, i: int) -> MemberState:
        """Member ``i``'s state, detached and copied to the CPU (for checkpoints)."""
        return {
            "step": float(self.step_count[i]),
            "state": {
                name: {key: t[i].detach().to("cpu", copy=True) for key, t in slots.items()}
                for name, slots in self.state.items()
            },
        }

    def select(self, keep: Sequence[int], params: Mapping[str, Tensor]) -> None:
        """Keep members ``keep`` (in that order); ``params`` are the array's new leaves."""
        index = torch.as_tensor(list(keep), dtype=torch.long, device=self.step_count.device)
        self.params = dict(params)
        self.hyper = {key: v[index] for key, v in self.hyper.items()}
        self.constants = {}
        self.step_count = self.step_count[index]
        self.state = {
            name: {key: t[index] for key, t in slots.items()} for name, slots in self.state.items()
        }


class StackedSGD(StackedOptimizer):
    """``torch.optim.SGD`` with dampening 0, per-member lr, momentum and weight decay."""

    hyper_keys = ("lr", "momentum", "weight_decay")
    state_keys = ("momentum_buffer",)

    def __init__(self, *args: Any, nesterov: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.nesterov = nesterov

    def _update(self) -> None:
        lr, momentum, wd = self.hyper["lr"], self.hyper["momentum"], self.hyper["weight_decay"]
        # torch.optim starts the buffer as a copy of the first gradient: with the
        # buffer at zero, scaling it by 0 on a member's first step gives exactly that.
        started = momentum * (self.step_count > 1)
        const, step = self.constants, Views()
        for name, p in self.params.items():
            if p.grad is None:
                continue
            grad = p.grad
            if self.decay:  # adding 0 * p would change nothing: skip it when every wd is 0
                grad = grad.addcmul(p, _view(const, "wd", lambda: wd, p))
            buf = self.state[name]["momentum_buffer"]
            buf.mul_(_view(step, "started", lambda: started, p)).add_(grad)
            if self.nesterov:
                grad = grad.addcmul(buf, _view(const, "momentum", lambda: momentum, p))
            else:
                grad = buf
            p.addcmul_(grad, _view(const, "-lr", lambda: -lr, p))


class StackedAdam(StackedOptimizer):
    """``torch.optim.Adam`` (L2 weight decay) or, with ``decoupled``, ``torch.optim.AdamW``."""

    hyper_keys = ("lr", "beta1", "beta2", "eps", "weight_decay")
    state_keys = ("exp_avg", "exp_avg_sq")

    def __init__(self, *args: Any, decoupled: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.decoupled = decoupled

    def _update(self) -> None:
        h = self.hyper
        lr, beta1, beta2, eps, wd = h["lr"], h["beta1"], h["beta2"], h["eps"], h["weight_decay"]
        neg_step_size = -(lr / (1 - beta1**self.step_count))
        bias_correction2_sqrt = (1 - beta2**self.step_count).sqrt()
        const, step = self.constants, Views()
        for name, p in self.params.items():
            if p.grad is None:
                continue
            grad = p.grad
            if self.decoupled:
                if self.decay:  # multiplying by 1 - lr * 0 would change nothing
                    p.mul_(_view(const, "1-lr*wd", lambda: 1 - lr * wd, p))
            elif self.decay:
                grad = grad.addcmul(p, _view(const, "wd", lambda: wd, p))
            exp_avg, exp_avg_sq = self.state[name]["exp_avg"], self.state[name]["exp_avg_sq"]
            exp_avg.lerp_(grad, _view(const, "1-beta1", lambda: 1 - beta1, p))
            exp_avg_sq.mul_(_view(const, "beta2", lambda: beta2, p)).addcmul_(
                grad, grad * _view(const, "1-beta2", lambda: 1 - beta2, p)
            )
            denom = (exp_avg_sq.sqrt() / _view(step, "bc2", lambda: bias_correction2_sqrt, p)).add_(
                _view(const, "eps", lambda: eps, p)
            )
            p.addcmul_(exp_avg / denom, _view(step, "-step_size", lambda: neg_step_size, p))


def build_optimizer(
    name: str,
    params: Mapping[str, Tensor],
    hyper: Mapping[str, Tensor],
    *,
    nesterov: bool = False,
    states: Sequence[MemberState | None] | None = None,
) -> StackedOptimizer:
    """The stacked optimizer called ``name`` (``sgd``, ``adam`` or ``adamw``).

    ``hyper`` values should be float64 (or Python floats): a float32 tensor
    has already rounded ``lr=0.1`` to 0.10000000149.
    ``states`` optionally gives each member's exported state (``None`` for a
    fresh member), so an array can resume trials that trained elsewhere.
    """
    if name == "sgd":
        return StackedSGD(params, hyper, states, nesterov=nesterov)
    if name in ("adam", "adamw"):
        return StackedAdam(params, hyper, states, decoupled=name == "adamw")
    raise ValueError(f"unknown optimizer {name!r}; expected sgd, adam or adamw")
