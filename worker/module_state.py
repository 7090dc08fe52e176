"""Python attributes of a model's own modules (a step counter a forward keeps on ``self``):
read, compared and carried over. torch's own modules (``nn.Linear``, ``nn.LSTM``) are left
out: what they keep (an LSTM's flat weights) is torch's bookkeeping, rebuilt as it needs.
Plain values (numbers, strings, containers of them) are compared by value, anything else by
identity: an attribute set to another object is seen, one changed in place is not."""

from __future__ import annotations

import copy
import sys
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy

_PLAIN = (int, float, complex, str, bytes, bool, type(None))


class _Missing:
    """An attribute an object does not have, as a value (a copy of it is itself)."""

    def __deepcopy__(self, memo: Any) -> _Missing:
        return self

    def __repr__(self) -> str:
        return "MISSING"


MISSING = _Missing()


def put(obj: Any, name: str, value: Any) -> None:
    """Set ``obj.name`` to ``value``; :data:`MISSING` removes the attribute (its class's
    value shows again)."""
    if value is MISSING:
        vars(obj).pop(name, None)
    else:
        setattr(obj, name, value)


def python_state(model: nn.Module) -> dict[str, Any]:
    """``module.attribute`` -> its value (a copy of a plain one), for every attribute of the
    model's modules whose classes are not torch's own (tensors and submodules aside)."""
    state: dict[str, Any] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        if type(module).__module__.split(".")[0] == "torch":
            continue
        for name, value in vars(module).items():
            if name in _TORCH_OWN or isinstance(value, nn.Module):
                continue
            full = f"{prefix}.{name}" if prefix else name
            state[full] = held_plain(value)
    return state


def changed_state(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """The names whose values differ between two :func:`python_state` readings."""
    return sorted(
        name
        for name in before.keys() | after.keys()
        if not _same(before.get(name, MISSING), after.get(name, MISSING))
    )


def copy_state(source: nn.Module, target: nn.Module, names: list[str]) -> None:
    """Set ``names`` (``module.attribute``) on ``target`` to their values on ``source``,
    both of one structure (a plain value copied, anything else shared)."""
    for full in names:
        prefix, _, name = full.rpartition(".")
        src, dst = source.get_submodule(prefix), target.get_submodule(prefix)
        if hasattr(src, name):
            value = getattr(src, name)
            setattr(dst, name, held_plain(value))
        elif hasattr(dst, name):
            delattr(dst, name)


@contextmanager
def kept_python_state(*modules: nn.Module) -> Iterator[None]:
    """Python attributes of ``modules`` as they were before the block: a pass packtune runs
    for itself (a shape pass on the meta device) must not count as a training step of a
    forward that keeps a step counter."""
    before = [python_state(module) for module in modules]
    try:
        yield
    finally:
        for module, held in zip(modules, before, strict=True):
            restore_python_state(module, held)


def restore_python_state(model: nn.Module, held: dict[str, Any]) -> list[str]:
    """Put the Python attributes of ``model``'s modules back to ``held`` (a
    :func:`python_state` reading of it); the names that had changed."""
    changed = changed_state(held, python_state(model))
    for full in changed:
        prefix, _, name = full.rpartition(".")
        restore(model.get_submodule(prefix), {name: held.get(full, MISSING)}, [name])
    return changed


def restore_object_state(obj: Any, held: dict[str, Any]) -> list[str]:
    """Put ``obj``'s own attributes back to ``held`` (an :func:`object_state` reading of it);
    the names that had changed."""
    changed = changed_state(held, object_state(obj))
    restore(obj, held, changed)
    return changed


#: a tensor attribute of a workload object up to this many elements is compared by value
#: (a counter kept as a tensor, changed in place); larger ones are data, by identity
SMALL_TENSOR = 4096


def object_state(obj: Any) -> dict[str, Any]:
    """``obj``'s own attributes (a workload object's): a copy of each plain value and of each
    small tensor (compared by value), anything else itself (compared by identity)."""
    return {name: held_value(value) for name, value in vars(obj).items()}


def held_value(value: Any) -> Any:
    """``value`` held at this moment: a copy of a plain value, a :class:`Snapshot` of a small
    tensor, an :class:`ArraySnapshot` of a small NumPy array (all compared by value), anything
    else itself (compared by identity)."""
    if _plain(value):
        return copy.deepcopy(value)
    if isinstance(value, torch.Tensor) and _small(value):
        return Snapshot(value.detach().clone(), value)
    if small_array(value):
        return ArraySnapshot(value.copy(), value)
    return value


def versioned(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` has a version counter to read (an inference-mode tensor has none;
    a meta tensor, or a lazy module's parameter not made yet, holds no values)."""
    if is_lazy(tensor):  # a lazy module's parameter, not made yet
        return False
    return not (tensor.is_meta or tensor.is_inference())


def _small(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is small enough to be held by value (and has values: not meta, nor
    a lazy module's parameter not made yet)."""
    if is_lazy(tensor):
        return False
    return tensor.numel() <= SMALL_TENSOR and not tensor.is_meta


def small_array(value: Any) -> bool:
    """Whether ``value`` is a NumPy array of numbers (or booleans) of up to
    :data:`SMALL_TENSOR` elements: a constant a build may fill in place (``NORM[:] = ...``)."""
    return number_array(value) and value.size <= SMALL_TENSOR


def number_array(value: Any) -> bool:
    """Whether ``value`` is a NumPy array of numbers (or booleans), of any size."""
    numpy = sys.modules.get("numpy")  # not imported here: if no one has, there are none
    return numpy is not None and type(value) is numpy.ndarray and value.dtype.kind in "biufc"


class Held:
    """A value held at a moment that compares itself (:func:`same_value`) with another."""

    def same_as(self, other: Any) -> bool:
        raise NotImplementedError


class _Copy(Held):
    """A value copied at a moment from an object (its source, held weakly: a small view of
    a large tensor must not keep the large one alive), put back by :meth:`restore`."""

    _source: Callable[[], Any]

    def _hold_source(self, source: Any) -> None:
        try:
            self._source = weakref.ref(source)
        except TypeError:  # None (from a checkpoint alone), or an object without weakrefs
            self._source = lambda: source

    @property
    def source(self) -> Any:
        """The object the value was read from (None where it is gone)."""
        return self._source()

    def fill(self, current: Any) -> bool:
        raise NotImplementedError

    def copy(self) -> Any:
        raise NotImplementedError

    def restore(self, current: Any) -> Any:
        """What to set where ``current`` is for it to hold this value: ``current`` itself,
        filled in place, where it is the object the value was read from (changed in place
        since: whoever else holds it sees the value); that object, filled, where another
        was set there since (not filling the new one, which a model built since may hold as
        its own: a NumPy array or tensor set anew per trial); a copy where neither can be
        filled (gone, another shape, an inference-mode or broadcast tensor)."""
        source = self.source
        target = current if current is source else source
        try:
            if target is not None and self.fill(target):
                return target
        except RuntimeError:  # not writable in place
            pass
        return self.copy()


class Snapshot(_Copy):
    """A small tensor's value at a moment (:func:`object_state`), compared by value;
    ``source``: the tensor it was read from (None: from a checkpoint alone)."""

    def __init__(self, tensor: torch.Tensor, source: torch.Tensor | None = None) -> None:
        self.tensor = tensor
        self._hold_source(source)

    def same_as(self, other: Any) -> bool:
        value = other.tensor if isinstance(other, Snapshot) else other
        return (
            isinstance(value, torch.Tensor)
            and value.shape == self.tensor.shape
            and value.dtype == self.tensor.dtype
            and value.device == self.tensor.device
            and value.layout == self.tensor.layout
            and _equal(value.detach(), self.tensor)
        )

    def fill(self, current: Any) -> bool:
        """Put the value back into ``current`` in place, whoever holds it seeing it back, if
        ``current`` is a tensor of the same shape; whether it was."""
        if not (isinstance(current, torch.Tensor) and current.shape == self.tensor.shape):
            return False
        with torch.no_grad():
            current.copy_(self.tensor)
        return True

    def copy(self) -> torch.Tensor:
        """A new tensor with the value."""
        return self.tensor.clone()


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of one layout hold the same values (a sparse one's too, which
    ``torch.equal`` does not take)."""
    if a.layout != torch.strided:
        a, b = a.to_dense(), b.to_dense()
    return bool(torch.equal(a, b))


class ArraySnapshot(_Copy):
    """A small NumPy array's value at a moment (:func:`held_value`), compared bit for bit
    (its shape, dtype and bytes: a NaN equals itself); ``source``: the array it was read
    from."""

    def __init__(self, array: Any, source: Any = None) -> None:
        self.array = array
        self._hold_source(source)

    def same_as(self, other: Any) -> bool:
        value = other.array if isinstance(other, ArraySnapshot) else other
        return (
            number_array(value)
            and value.shape == self.array.shape
            and value.dtype == self.array.dtype
            and value.tobytes() == self.array.tobytes()
        )

    def fill(self, current: Any) -> bool:
        """Put the value back into ``current`` in place, whoever holds it seeing it back, if
        ``current`` is a writeable array of the same shape and dtype; whether it was."""
        if not (
            number_array(current)
            and current.shape == self.array.shape
            and current.dtype == self.array.dtype
            and current.flags.writeable
        ):
            return False
        current[...] = self.array
        return True

    def copy(self) -> Any:
        """A new array with the value."""
        return self.array.copy()


def restore(obj: Any, held: dict[str, Any], names: list[str]) -> None:
    """Put ``names`` of ``obj`` back to their values in ``held`` (:func:`object_state` or
    :func:`python_state`'s, per module); a name ``held`` lacks, or holds as :data:`MISSING`,
    is removed."""
    for name in names:
        value = held.get(name, MISSING)
        if isinstance(value, _Copy):
            current = vars(obj).get(name, MISSING)
            value = value.restore(current)
            if value is current:
                continue
        put(obj, name, held_plain(value))


def set_python_state(model: nn.Module, values: dict[str, Any]) -> None:
    """Set ``module.attribute`` of ``model`` to each of ``values`` (a copy)."""
    for full, value in values.items():
        prefix, _, name = full.rpartition(".")
        setattr(model.get_submodule(prefix), name, copy.deepcopy(value))


def checkpointable(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` can go into a checkpoint (``torch.load(weights_only=True)`` reads it
    back): numbers, strings, None, and lists, tuples and string-keyed dicts of them, of
    exactly these types (a NumPy float, an Enum member or a defaultdict is not read back);
    a small tensor."""
    if value is None or type(value) in (bool, int, float, str):  # not NumPy's, an Enum
        return True
    if isinstance(value, torch.Tensor):  # a small one: a counter kept as a tensor
        return depth == 0 and _small(value)
    if depth >= 3:
        return False
    if type(value) in (list, tuple):
        return all(checkpointable(v, depth + 1) for v in value)
    if type(value) is dict:
        return all(type(k) is str and checkpointable(v, depth + 1) for k, v in value.items())
    return False


#: what every ``nn.Module`` keeps in its ``__dict__`` (parameters, buffers, hooks, ``training``)
_TORCH_OWN = frozenset(vars(nn.Module()))


def held_plain(value: Any) -> Any:
    """A copy of a plain value (compared by value), anything else itself (by identity)."""
    return copy.deepcopy(value) if _plain(value) else value


def same_value(a: Any, b: Any) -> bool:
    """Whether two held values are the same (:func:`changed_state`'s comparison)."""
    return _same(a, b)


def _plain(value: Any, depth: int = 0) -> bool:
    if isinstance(value, _PLAIN):
        return True
    if depth >= 3:
        return False
    if isinstance(value, list | tuple | set | frozenset):
        return all(_plain(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(_plain(k, depth + 1) and _plain(v, depth + 1) for k, v in value.items())
    return False


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, Held):
        return a.same_as(b)
    if isinstance(b, Held):
        return b.same_as(a)
    if not (_plain(a) and _plain(b)) or type(a) is not type(b):
        return False  # another object in its place
    return bool(a == b) or (a != a and b != b)  # nan: the same value
