"""Forward passes over a stack of k members' parameters (``[k, ...]`` each).

Three ways to run the stack (:mod:`worker.fused` picks one per array):

- ``vmap``: ``torch.func.vmap(functional_call)`` over the stacked tensors with
  the shared batch (``in_dims=None``). BatchNorm in train mode updates its
  running statistics in place; because the statistics are themselves stacked
  (batched, not a plain tensor receiving a batched update, which vmap
  refuses), each member's slice gets its own update, exactly as in a plain
  run. ``torch.func.replace_all_batch_norm_modules_`` is *not* used: it stops
  tracking the statistics, and eval-mode results would then differ.
- ``bmm``: hand-fused for ``nn.Sequential`` stacks of Linear, BatchNorm1d,
  element-wise activations, Dropout and Flatten (and, asked for, Conv2d,
  BatchNorm2d and 2-d pooling: :func:`bmm_plan`'s ``convs``). Linear layers are
  ``torch.baddbmm`` over ``[k, B, in]`` activations (the shared input is
  expanded, not copied); BatchNorm runs as one ``F.batch_norm`` over ``k*C``
  channels. (One ``[B, in] @ [in, k*out]`` matmul for the first layer measured
  no faster, and its rounding would depend on the companions.)
- ``serial``: k separate models, one after another (the baseline, and what
  the planner picks where fusion measured slower, e.g. CNNs on a CPU).

Every forward takes ``(params, buffers, x)`` with ``x`` the shared ``[B, ...]``
batch, or with ``stacked=True`` the members' own batches ``[k, B, ...]`` (a workload
with ``per_member_batches``), and returns ``[k, B, ...]``.

A workload with its own per-batch step (``training_loss``) has no single forward: its
step is :func:`custom_losses` (vmap of the workload's step over the members, or one
member's plain call), which returns the ``[k]`` losses directly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, vmap
from torch.nn import functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from worker.batches import tree_map
from worker.ties import aliases

Forward = Callable[[dict[str, Tensor], dict[str, Tensor], Tensor], Tensor]
#: ``(params, buffers, batch) -> [k]`` losses of a custom per-batch step
Losses = Callable[[dict[str, Tensor], dict[str, Tensor], Any], Tensor]

# Modules that act element-wise, so they apply unchanged to ``[k, B, F]``.
_POINTWISE = (
    nn.Identity, nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU,
    nn.Mish, nn.Tanh, nn.Sigmoid, nn.Softplus, nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid,
    nn.Dropout, nn.AlphaDropout,
)  # fmt: skip
# 2-d pooling: each channel alone, so it applies unchanged to k*C channels
_POOLING = (nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d)


def bmm_plan(model: nn.Module, convs: bool = False) -> list[tuple[str, nn.Module, str]] | None:
    """``(kind, module, name prefix)`` steps of a hand-fusable model, or ``None``.

    Fusable: an ``nn.Sequential`` (nested ones too) of Linear, BatchNorm1d
    with a momentum, element-wise activations, Dropout and ``Flatten()``; with
    ``convs``, also Conv2d (zero padding), BatchNorm2d with a momentum and 2-d
    pooling (HFTA's fused convolutions: k members' Conv2d as one grouped
    convolution, BatchNorm2d as one over k*C channels, pooling over k*C channels).
    Those classes exactly, not subclasses (a subclass may have its own ``forward``),
    and no hooks on any module or registered for all of them: the hand-fused forward
    reads the modules' weights and never calls them. No tensor under two names (tied
    weights, a Linear used twice: :mod:`worker.ties`); a parameterless module used twice
    (one activation at every place) is a step at each place.
    """
    steps: list[tuple[str, nn.Module, str]] = []
    if _global_hooks() or aliases(model):
        return None  # tied tensors: vmap's functional_call follows the template's ties

    def walk(module: nn.Module, prefix: str) -> bool:
        if _hooked(module):
            return False
        if isinstance(module, nn.Sequential) and type(module).forward is nn.Sequential.forward:
            # every place of a module used twice (named_children lists it once), as its
            # forward calls it
            return all(walk(child, f"{prefix}{name}.") for name, child in module._modules.items()
                       if child is not None)  # fmt: skip
        if type(module) is nn.Linear:
            steps.append(("linear", module, prefix))
        elif type(module) is nn.BatchNorm1d and module.momentum is not None:
            steps.append(("batch_norm", module, prefix))
        elif convs and type(module) is nn.Conv2d and module.padding_mode == "zeros":
            steps.append(("conv", module, prefix))
        elif convs and type(module) is nn.BatchNorm2d and module.momentum is not None:
            steps.append(("batch_norm", module, prefix))
        elif convs and type(module) in _POOLING and not getattr(module, "return_indices", False):
            steps.append(("pool", module, prefix))
        elif type(module) is nn.Flatten and (module.start_dim, module.end_dim) == (1, -1):
            steps.append(("flatten", module, prefix))
        elif type(module) in _POINTWISE:
            steps.append(("pointwise", module, prefix))
        else:
            return False
        return True

    return steps if walk(model, "") else None


def _hooked(module: nn.Module) -> bool:
    """``module`` has hooks that calling it would run: the hand-fused forward never calls
    a module, so it would train a model without them (vmap's ``functional_call`` does)."""
    return bool(
        module._forward_hooks or module._forward_pre_hooks
        or module._backward_hooks or module._backward_pre_hooks
    )  # fmt: skip


def _global_hooks() -> bool:
    """Hooks registered for every module (``nn.modules.module.register_module_*_hook``)."""
    from torch.nn.modules import module as mod

    return bool(
        mod._global_forward_hooks or mod._global_forward_pre_hooks
        or mod._global_backward_hooks or mod._global_backward_pre_hooks
    )  # fmt: skip


def _stacked_batch_norm(
    h: Tensor, bn: _BatchNorm, params: dict[str, Tensor], buffers: dict[str, Tensor], pre: str
) -> Tensor:
    """BatchNorm1d/2d of ``[k, B, C, ...]`` as one ``F.batch_norm`` over ``k*C`` channels."""
    k, batch, channels = h.shape[:3]
    track = bn.track_running_stats
    if bn.training and track:
        buffers[pre + "num_batches_tracked"].add_(1)
    running_mean = buffers[pre + "running_mean"].view(-1) if track else None
    running_var = buffers[pre + "running_var"].view(-1) if track else None
    weight = params[pre + "weight"].reshape(-1) if bn.affine else None
    bias = params[pre + "bias"].reshape(-1) if bn.affine else None
    flat = h.movedim(0, 1).reshape(batch, k * channels, *h.shape[3:])
    out = F.batch_norm(
        flat, running_mean, running_var, weight, bias,
        bn.training or not track, bn.momentum or 0.0, bn.eps,
    )  # fmt: skip
    return out.reshape(batch, k, channels, *h.shape[3:]).movedim(1, 0)


def _channels_of_all(h: Tensor) -> Tensor:
    """``[k, B, C, H, W]`` as ``[B, k*C, H, W]`` (free when ``h`` came from that layout)."""
    k, batch = h.shape[:2]
    return h.movedim(0, 1).reshape(batch, k * h.shape[2], *h.shape[3:])


def _members_of(flat: Tensor, k: int) -> Tensor:
    """``[B, k*C, H, W]`` back as ``[k, B, C, H, W]`` (a view)."""
    batch, channels = flat.shape[:2]
    return flat.view(batch, k, channels // k, *flat.shape[2:]).movedim(1, 0)


def _stacked_conv(h: Tensor, conv: nn.Conv2d, params: dict[str, Tensor], pre: str) -> Tensor:
    """k members' Conv2d of ``[k, B, C, H, W]`` as one convolution of ``k * groups``
    groups over ``[B, k*C, H, W]``: each group sees one member's channels and weights."""
    k = h.shape[0]
    weight = params[pre + "weight"]  # [k, O, C / groups, kh, kw]
    bias = params.get(pre + "bias")
    out = F.conv2d(
        _channels_of_all(h), weight.reshape(-1, *weight.shape[2:]),
        None if bias is None else bias.reshape(-1),
        conv.stride, conv.padding, conv.dilation, k * conv.groups,
    )  # fmt: skip
    return _members_of(out, k)


#: per (operands' shapes, strides, dtypes, device, autocast, torch's thread count: MKL's
#: choice of kernel depends on it): whether a batch of one member's matrix
#: product rounds as it does in a batch of several. A CPU BLAS may route a batch of one
#: to another kernel (MKL on an AMD EPYC: ``[1, 10, B] @ [1, B, 128]``, a last layer's
#: weight gradient, rounded apart from the same product in a batch of 2 or more), and a
#: trial alone would then train apart from the same trial packed.
_ONE_ROUNDS_ALIKE: dict[tuple[Any, ...], bool] = {}


def _product(a: Tensor, b: Tensor, bias: Tensor | None) -> Tensor:
    return torch.bmm(a, b) if bias is None else torch.baddbmm(bias, a, b)


def _pair(t: Tensor) -> Tensor:
    return t.expand(2, *t.shape[1:])


def stacked_product(a: Tensor, b: Tensor, bias: Tensor | None = None) -> Tensor:
    """``bmm(a, b)`` (``baddbmm(bias, a, b)``) over stacks, a stack of one member computed as
    the same member in a stack of several: on its own where the two round alike (tried
    once per shapes, strides, autocast and thread count, on random values from a
    generator of its own), else as a stack of two (the member twice; its first kept)."""
    if a.shape[0] != 1 or torch.compiler.is_compiling():
        return _product(a, b, bias)
    device = a.device.type
    autocast = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    key = (a.shape, a.stride(), b.shape, b.stride(),
           None if bias is None else (bias.shape, bias.stride()), a.dtype, b.dtype, a.device,
           autocast, torch.get_num_threads())  # fmt: skip
    alike = _ONE_ROUNDS_ALIKE.get(key)
    if alike is None:
        alike = _ONE_ROUNDS_ALIKE[key] = _rounds_alike(a, b, bias)
    if alike:
        return _product(a, b, bias)
    return _product(_pair(a), _pair(b), None if bias is None else _pair(bias))[:1]


def _rounds_alike(a: Tensor, b: Tensor, bias: Tensor | None) -> bool:
    generator = torch.Generator(a.device).manual_seed(0)  # torch's own streams untouched

    def like(t: Tensor) -> Tensor:  # t's strides, an expanded (overlapping) t's included
        span = 1 + sum(
            (size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True)
        )
        flat = torch.empty(span, dtype=t.dtype, device=t.device).normal_(generator=generator)
        return flat.as_strided(t.shape, t.stride())

    with torch.no_grad():
        ra, rb = like(a), like(b)
        rbias = None if bias is None else like(bias)
        one = _product(ra, rb, rbias)
        two = _product(_pair(ra), _pair(rb), None if rbias is None else _pair(rbias))[:1]
        return bool(torch.equal(one, two))


class _StackedLinear(torch.autograd.Function):
    """``h @ w.mT + b`` over stacks (``h [k, B, in]``, ``w [k, out, in]``, ``b [k, out]``).

    Autograd's own backward of ``baddbmm(b, h, w.mT)`` computes the weight
    gradient as ``h.mT @ g`` and transposes it, and accumulating that transposed
    ``[k, in, out]`` into ``w.grad`` copies it: on a CPU the strided copy cost
    more than the matrix product. Here it is ``g.mT @ h``, already in ``w``'s
    layout (the same sums; equal to the bit on the CPUs tested).
    """

    @staticmethod
    def forward(ctx: Any, h: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        ctx.save_for_backward(h, w)
        ctx.has_bias = b is not None
        return stacked_product(h, w.mT, None if b is None else b.unsqueeze(1))

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        h, w = ctx.saved_tensors
        # Under bf16 autocast the forward ran in bf16 (autocast casts baddbmm's operands)
        # and g is bf16, while w (the float32 master weight) and the first layer's input are
        # not: compute in g's precision, as autograd's own backward of an autocast matmul
        # does; autograd casts each gradient back to its input's dtype.
        h, w = h.to(g.dtype), w.to(g.dtype)
        grad_h = stacked_product(g, w) if ctx.needs_input_grad[0] else None
        grad_w = stacked_product(g.mT, h) if ctx.needs_input_grad[1] else None
        grad_b = g.sum(1) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_h, grad_w, grad_b


class MemberStreams:
    """Each member's own dropout stream in a hand-fused stack: a generator per member on
    the stack's device, seeded before each step from one draw of the member's own stream
    (:meth:`seed`). A member's masks then depend on its stream alone, whoever it is stacked
    with and whatever the stack's size: fused or alone, it draws the same masks."""

    def __init__(self) -> None:
        self.generators: list[torch.Generator] = []
        self._device: torch.device | None = None

    def seed(self, seeds: list[int], device: torch.device) -> None:
        if self._device != device:
            self.generators, self._device = [], device
        while len(self.generators) < len(seeds):
            self.generators.append(torch.Generator(device))
        del self.generators[len(seeds) :]
        for generator, seed in zip(self.generators, seeds, strict=True):
            generator.manual_seed(seed)


def member_mask(
    shape: Sequence[int], dtype: torch.dtype, device: torch.device, keep: float,
    generator: torch.Generator,
) -> Tensor:  # fmt: skip
    """One member's dropout mask (1 with probability ``keep``) from its own ``generator``:
    every stack draws a member's masks with it, so a member draws alike in any stack."""
    return torch.empty(shape, dtype=dtype, device=device).bernoulli_(keep, generator=generator)


def member_dropout(h: Tensor, p: float, streams: MemberStreams) -> Tensor:
    """Inverted dropout of ``[k, ...]``, member j's mask drawn from its own generator: each
    member's slice is what ``h[j] * mask / (1 - p)`` gives alone (element-wise, so exact)."""
    if p >= 1.0:
        return h * 0.0
    keep = 1.0 - p
    masks = torch.stack(
        [member_mask(h.shape[1:], h.dtype, h.device, keep, g) for g in streams.generators]
    )
    return h * masks / keep


def bmm_forward(
    plan: list[tuple[str, nn.Module, str]],
    stacked: bool = False,
    streams: MemberStreams | None = None,
) -> Forward:
    """Forward of a stack following ``plan``: shared ``[B, ...]`` (or with ``stacked``, the
    members' own ``[k, B, ...]``) in, ``[k, B, ...]`` out. With ``streams``, Dropout layers
    in training mode draw each member's mask from its own stream (:class:`MemberStreams`);
    without, from torch's global generator, one draw for the stack."""

    def forward(params: dict[str, Tensor], buffers: dict[str, Tensor], x: Tensor) -> Tensor:
        k = next(iter(params.values())).shape[0]
        h, shared = x, not stacked  # shared: still the one input every member sees
        for kind, module, pre in plan:
            if kind == "flatten":
                h = h.flatten(1 if shared else 2)
                continue
            if shared:
                h, shared = h.expand(k, *h.shape), False
            if kind == "linear":  # over the last dimension, whatever comes between
                lead = h.shape[1:-1]
                flat = h.reshape(k, -1, h.shape[-1]) if len(lead) > 1 else h
                h = _StackedLinear.apply(flat, params[pre + "weight"], params.get(pre + "bias"))
                h = h.reshape(k, *lead, h.shape[-1]) if len(lead) > 1 else h
            elif kind == "batch_norm":
                assert isinstance(module, _BatchNorm)
                h = _stacked_batch_norm(h, module, params, buffers, pre)
            elif kind == "conv":
                assert isinstance(module, nn.Conv2d)
                h = _stacked_conv(h, module, params, pre)
            elif kind == "pool":  # over each of the k*C channels alone
                h = _members_of(module(_channels_of_all(h)), k)
            elif streams is not None and type(module) is nn.Dropout and module.training:
                h = member_dropout(h, float(module.p), streams) if module.p > 0 else h
            else:
                h = module(h)
        return h.expand(k, *h.shape) if shared else h

    return forward


def vmap_forward(template: nn.Module, stacked: bool = False) -> Forward:
    """``vmap`` of ``functional_call`` over stacked params and buffers, input shared (or
    with ``stacked``, each member's own)."""

    def one(params: dict[str, Tensor], buffers: dict[str, Tensor], x: Tensor) -> Tensor:
        return functional_call(template, (params, buffers), (x,))

    dims = (0, 0, 0 if stacked else None)
    return vmap(one, in_dims=dims, randomness="different")  # type: ignore[no-any-return]


def member(params: dict[str, Tensor], buffers: dict[str, Tensor]) -> tuple[dict, dict]:
    """Member 0's parameters and buffers, of stacked ones."""
    return {n: p[0] for n, p in params.items()}, {n: b[0] for n, b in buffers.items()}


def _first(batch: Any) -> Any:
    """Member 0's slice of a stacked batch (any nesting of tensors)."""
    return tree_map(lambda t: t[0], batch)


def single_forward(template: nn.Module, stacked: bool = False) -> Forward:
    """A plain call of one member (stack of 1), for serial mode: no vmap overhead."""

    def forward(params: dict[str, Tensor], buffers: dict[str, Tensor], x: Tensor) -> Tensor:
        return functional_call(
            template, member(params, buffers), (x[0] if stacked else x,)
        ).unsqueeze(0)

    return forward


def model_function(
    template: nn.Module, params: dict[str, Tensor], buffers: dict[str, Tensor]
) -> Callable[..., Any]:
    """One member's model as a function of any inputs (its tensors, ``template``'s code)."""

    def model(*args: Any, **kwargs: Any) -> Any:
        return functional_call(template, (params, buffers), args, kwargs)

    return model


def custom_losses(
    step: Callable[[Callable[..., Any], Any], Tensor],
    template: nn.Module,
    serial: bool,
    stacked: bool = False,
) -> Losses:
    """The ``[k]`` losses of a workload's own per-batch ``step`` (``training_loss``): under
    ``vmap`` over the members (the batch shared, or each member's with ``stacked``), or,
    ``serial``, one member's plain call."""

    def one(params: dict[str, Tensor], buffers: dict[str, Tensor], batch: Any) -> Tensor:
        return step(model_function(template, params, buffers), batch)

    if serial:

        def single(params: dict[str, Tensor], buffers: dict[str, Tensor], batch: Any) -> Tensor:
            return one(*member(params, buffers), _first(batch) if stacked else batch).reshape(1)

        return single
    dims = (0, 0, 0 if stacked else None)
    return vmap(one, in_dims=dims, randomness="different")  # type: ignore[no-any-return]
