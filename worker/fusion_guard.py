"""Which members of an array may share one stacked model: equal models but for tensor values.

A fused array runs every member through *one* template module (the first
member's) with the members' stacked parameters and buffers. That is exact only
when the members' models differ in nothing but the values of those tensors.
A parameter that changes the forward pass without changing any shape (an
activation, a dropout rate, a residual flag) would otherwise make every member
train the first member's model, silently.

:func:`model_signature` describes a built model by everything except its
parameter and buffer values: the module tree (names and classes), every
module's other attributes (floats, flags, functions, tensors that are not
registered as parameters or buffers, hooks), and the names, shapes, dtypes and
``requires_grad`` of its parameters and buffers. Members whose signatures
differ are never fused with each other.

Classes created inside ``build_model`` (a new class object per call) compare
equal when they are made by the same code with equal closed-over values and
class attributes (``__init__`` aside: what it made is in the instance's
attributes, compared above): one template then serves them all. Anything this module
cannot compare by value (an object with identity semantics only, or nesting
deeper than :data:`~packtune.tuning.GUARD_MAX_DEPTH`) is taken as different, so an unsure case costs
speed (separate stacks), never correctness.
"""

from __future__ import annotations

import functools
import hashlib
import sys
import types
import weakref
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from packtune.tuning import GUARD_MAX_DEPTH
from packtune.workloads.base import OPTIMIZER_HYPER
from worker.ties import aliases, reused_modules

#: Config keys that always differ between members and say nothing about a split's cause.
_PER_MEMBER_KEYS = frozenset({"seed"})
#: config keys packtune carries per member itself: the fused optimizer's hyperparameters
#: (schedules included) and the study's horizon; unlikely to shape a model
_CARRIED_KEYS = frozenset({*OPTIMIZER_HYPER, "max_epochs"})
#: A class's own entries that say nothing about behaviour once an instance exists
#: (``__init__``'s work is in the instance's attributes, which are compared themselves).
_CLASS_NOISE = frozenset({
    "__dict__", "__weakref__", "__doc__", "__module__", "__qualname__", "__firstlineno__",
    "__static_attributes__", "__annotations__", "__orig_bases__", "__parameters__", "__init__",
})  # fmt: skip
#: A module's own entries compared separately (tensors by shape) or not at all (mode).
_MODULE_SLOTS = frozenset({"_parameters", "_buffers", "_modules", "training"})
_HOOK_DICTS = frozenset({
    "_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
    "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks", "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs",
    "_forward_hooks_always_called",
})  # fmt: skip


class _Opaque:
    """Stands for a value that cannot be compared by value: equal only to itself."""

    __slots__ = ()


def model_signature(model: nn.Module) -> Hashable:
    """Everything about ``model`` that a fused array's shared template must agree on."""
    names: dict[int, Any] = {id(m): name for name, m in model.named_modules()}
    # a registered tensor held elsewhere too (an RNN's flat weights) is stacked per member
    # like any: by its name, not its values (which differ between members)
    for kind, tensors in (("parameter", model.named_parameters(remove_duplicate=False)),
                          ("buffer", model.named_buffers(remove_duplicate=False))):  # fmt: skip
        for name, tensor in tensors:
            names.setdefault(id(tensor), (kind, name))
    rows: list[Hashable] = []
    for name, module in model.named_modules():
        attrs = tuple(
            (key, _attribute(key, value, names))
            for key, value in module.__dict__.items()
            if key not in _MODULE_SLOTS
        )
        params = tuple(
            (key, None if p is None else (tuple(p.shape), p.dtype, p.requires_grad, type(p)))
            for key, p in module._parameters.items()
        )
        buffers = tuple(
            (key, None if b is None else (tuple(b.shape), b.dtype, type(b)))
            for key, b in module._buffers.items()
        )
        children = tuple(module._modules)
        rows.append((name, _class(type(module), 0), attrs, params, buffers, children))
    rows.append(("ties", tuple(sorted(aliases(model).items())), reused_modules(model)))
    return tuple(rows)


def _attribute(key: str, value: Any, names: Mapping[int, str]) -> Hashable:
    if key in _HOOK_DICTS and isinstance(value, Mapping):
        return tuple(_value(hook, names, 0) for hook in value.values())  # handle ids differ
    if key == "_non_persistent_buffers_set":
        return frozenset(value)
    return _value(value, names, 0)


def _value(value: Any, names: Mapping[int, str], depth: int) -> Hashable:
    """A hashable stand-in for ``value`` that equals another's when they behave the same."""
    if depth > GUARD_MAX_DEPTH:
        return _Opaque()
    deeper = functools.partial(_value, names=names, depth=depth + 1)
    if value is None or isinstance(value, bool | int | str | bytes):
        return (type(value), value)
    if isinstance(value, float | complex):
        return (type(value), repr(value))  # nan == nan, and -0.0 != 0.0
    if isinstance(value, torch.Tensor):
        return ("registered", names[id(value)]) if id(value) in names else _tensor(value)
    if isinstance(value, nn.Module):
        # another module of the tree by its name; one outside the tree by its own signature
        return ("module", names[id(value)]) if id(value) in names else ("free", _opaque_or(value))
    if isinstance(value, torch.dtype | torch.device | torch.Size | torch.layout):
        return (type(value), str(value))
    if isinstance(value, tuple | list):
        return (type(value), tuple(deeper(item) for item in value))
    if isinstance(value, dict):
        return (type(value), tuple((deeper(k), deeper(v)) for k, v in value.items()))
    if isinstance(value, set | frozenset):
        return (type(value), frozenset(deeper(item) for item in value))
    if isinstance(value, type):
        return _class(value, depth + 1)
    if isinstance(value, types.FunctionType):
        return _function(value, names, depth + 1)
    if isinstance(value, types.MethodType):
        owner = value.__self__
        me = ("module", names[id(owner)]) if id(owner) in names else deeper(owner)
        return ("method", deeper(value.__func__), me)
    if isinstance(value, functools.partial):
        return ("partial", deeper(value.func), deeper(value.args), deeper(value.keywords))
    if isinstance(value, weakref.ref):  # an RNN's to its parameters: what it refers to
        return ("weakref", deeper(value()))
    if isinstance(value, types.BuiltinFunctionType | types.ModuleType):
        return ("same", value)  # torch.relu, math.sqrt, a module: one object per process
    return _opaque_or(value)


def _opaque_or(value: Any) -> Hashable:
    """A value of a class with value equality as itself; anything else is opaque."""
    if type(value).__eq__ is not object.__eq__ and type(value).__hash__ is not None:
        try:
            hash(value)
        except TypeError:
            return _Opaque()
        return ("value", _class(type(value), 0), value)
    return _Opaque()


def _tensor(t: torch.Tensor) -> Hashable:
    """A tensor that is not a registered parameter or buffer: its values are not stacked, so
    they count (the template's would serve every member)."""
    data = t.detach().to("cpu").contiguous().reshape(-1)
    digest = hashlib.sha256(data.view(torch.uint8).numpy().tobytes()).hexdigest()
    return ("tensor", tuple(t.shape), t.dtype, digest)


def _function(fn: types.FunctionType, names: Mapping[int, str], depth: int) -> Hashable:
    """Same code, equal closed-over values and defaults: the same function for our purpose."""
    cells = tuple(_value(_cell(c), names, depth) for c in fn.__closure__ or ())
    defaults = _value(fn.__defaults__, names, depth)
    kwdefaults = _value(fn.__kwdefaults__, names, depth)
    return ("function", fn.__code__, cells, defaults, kwdefaults)


def _cell(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return _Opaque


def _class(cls: type, depth: int) -> Hashable:
    """A class defined at a module's top level by identity; one made inside a function (a new
    object per call) by its code: name, bases and every attribute of its own."""
    if "<locals>" not in cls.__qualname__:
        return ("class", cls)
    if depth > GUARD_MAX_DEPTH:
        return _Opaque()
    own = tuple(
        (key, _value(value, {}, depth + 1))
        for key, value in cls.__dict__.items()
        if key not in _CLASS_NOISE
    )
    bases = tuple(_class(base, depth + 1) for base in cls.__bases__)
    return ("local class", cls.__module__, cls.__qualname__, bases, own)


def partition(signatures: Sequence[Hashable]) -> list[list[int]]:
    """Indices of equal signatures, grouped in order of first appearance."""
    groups: dict[Hashable, list[int]] = {}
    for i, signature in enumerate(signatures):
        groups.setdefault(signature, []).append(i)
    return list(groups.values())


def split_causes(configs: Sequence[Mapping[str, Any]], parts: Sequence[Sequence[int]]) -> list[str]:
    """The config keys that most likely made ``parts`` differ.

    First the keys constant inside every part but different between parts; failing
    that, every key whose values differ at all (the seed only when nothing else does:
    then the model depends on the trial's seed). The optimizer's hyperparameters and
    the study's horizon (``max_epochs``), which packtune itself carries per member, are
    named only when nothing else can be (with parts of one member each, every key that
    differs is constant inside every part).
    """
    keys = sorted({key for config in configs for key in config} - {"data_seed"})

    def values(key: str, idx: Sequence[int]) -> set[str]:
        return {repr(configs[i].get(key)) for i in idx}

    varying = [key for key in keys if len(values(key, range(len(configs)))) > 1]
    likely = [key for key in varying if key not in _PER_MEMBER_KEYS | _CARRIED_KEYS]
    exact = [key for key in likely if all(len(values(key, part)) == 1 for part in parts)]
    return (
        exact
        or likely
        or [key for key in varying if key in _PER_MEMBER_KEYS]
        or [key for key in varying if key in _CARRIED_KEYS]
    )


def workload_differences(states: Sequence[Mapping[str, Any]]) -> list[str]:
    """The attributes of a workload object (``states``: its ``vars()`` after each member's
    ``build_model``) whose values differ between members: ``build_model`` keeping a
    per-trial value (``self.label_smoothing = cfg["label_smoothing"]``) that the loss then
    reads, while a stack's members share one workload's loss. Values are compared by what
    they hold (tensors and arrays by value, containers item by item, a module by its
    signature and tensors); what cannot be compared counts as different."""
    first, *rest = states
    names = sorted({name for state in states for name in state})
    return [
        name
        for name in names
        if any(
            not _same(first.get(name, _MISSING), state.get(name, _MISSING), 0) for state in rest
        )  # fmt: skip
    ]


_MISSING = object()


def _same(a: Any, b: Any, depth: int) -> bool:
    if a is b:
        return True
    if depth > GUARD_MAX_DEPTH or type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return (a.shape, a.dtype, a.device) == (b.shape, b.dtype, b.device) and bool(
            torch.equal(a, b)
        )
    if isinstance(a, float):
        return a == b or (a != a and b != b)  # nan: the same value
    if isinstance(a, nn.Module):
        ta, tb = a.state_dict(), b.state_dict()
        return model_signature(a) == model_signature(b) and _same(ta, tb, depth + 1)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k], depth + 1) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y, depth + 1) for x, y in zip(a, b, strict=True))
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(a, numpy.ndarray):
        return a.shape == b.shape and a.dtype == b.dtype and bool(numpy.array_equal(a, b))
    try:
        return bool(a == b)
    except Exception:  # an ambiguous or failing comparison: unsure, so different
        return False
