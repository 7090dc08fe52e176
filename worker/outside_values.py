"""How :mod:`worker.outside_state` holds a value kept outside the model at a moment, and puts
it back.

A value changed *in place* is held by value, not only one set anew: a settings object
(``SETTINGS.scale = ...``: a dataclass, a ``SimpleNamespace``), a dict or list whose entries
are set (``CONFIG["scale"] = ...``), a small tensor filled (``FACTOR.fill_(...)``). And it is
put back in place, into the object it was read from (set there again where another was set
since), so that whoever else holds that object (a model that keeps ``self.config =
CONFIG``) reads the member's value too.

- a random generator (a ``torch.Generator``, a ``random.Random``, NumPy's ``RandomState``
  or ``Generator``; ``GEN.manual_seed(seed)`` in ``build_model``): :class:`RandomState`,
  its state, put back with the generator's own setter;
- a plain value (numbers, strings, containers of them): a copy, compared by value;
- a small tensor: a :class:`~worker.module_state.Snapshot` of it, compared by value; a small
  NumPy array of numbers (``NORM[:] = ...``) likewise (:class:`~worker.module_state.ArraySnapshot`);
- a dict or list of other things, and an object of the user's own classes (or a
  ``SimpleNamespace``, an ``argparse.Namespace``): :class:`Fields`, the object itself
  (compared by identity) and each of its entries or attributes held in turn, a few levels
  deep; one of more than :data:`MAX_FIELDS` is data, not settings, and held as itself;
- anything else itself, compared by identity.
"""

from __future__ import annotations

import argparse
import copy
import enum
import random
import sys
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from worker.module_state import (
    MISSING,
    ArraySnapshot,
    Held,
    Snapshot,
    held_plain,
    held_value,
    same_value,
)

#: an object or container with more fields than this is data, not settings: held as itself
MAX_FIELDS = 1024
#: how deep objects within objects are held field by field
MAX_DEPTH = 3
_NAMESPACES = (types.SimpleNamespace, argparse.Namespace)
_NOT_SETTINGS = (
    type, types.ModuleType, types.FunctionType, types.MethodType, nn.Module, enum.Enum
)  # fmt: skip

#: whether a class is the user's own (its instances held field by field)
Own = Callable[[type], bool]


class Fields(Held):
    """An object and its fields at a moment: a settings object's attributes, or the entries
    of a dict or list. Compared by the object's identity and each field's value."""

    def __init__(self, obj: Any, fields: dict[Any, Any]) -> None:
        self.obj, self.fields = obj, fields

    def same_as(self, other: Any) -> bool:
        return (
            isinstance(other, Fields)
            and other.obj is self.obj
            and other.fields.keys() == self.fields.keys()
            and all(same_value(v, other.fields[k]) for k, v in self.fields.items())
        )

    def put(self) -> Any:
        """The object, its fields set back to these values (in place)."""
        obj = self.obj
        if isinstance(obj, list):
            _fill_list(obj, list(self.fields.values()))
        elif isinstance(obj, dict) or not _slots(type(obj)):
            # an object through its __dict__, as read: a frozen dataclass's too
            _fill_dict(obj if isinstance(obj, dict) else vars(obj), self.fields)
        else:
            _fill_object(obj, self.fields)
        return obj


class Same(Held):
    """A dict, list or set held as itself (data: more than :data:`MAX_FIELDS` entries, or
    deeper than :data:`MAX_DEPTH`): compared by identity, put back by setting it again,
    never by filling another one with it."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def same_as(self, other: Any) -> bool:
        return isinstance(other, Same) and other.obj is self.obj


class RandomState(Held):
    """A random generator and its state at a moment."""

    def __init__(self, generator: Any, state: Any) -> None:
        self.generator, self.state = generator, state

    def same_as(self, other: Any) -> bool:
        return (
            isinstance(other, RandomState)
            and other.generator is self.generator
            and _same_state(self.state, other.state)
        )

    def put(self) -> Any:
        """The generator, its state set back to this one."""
        _set_state(self.generator, self.state)
        return self.generator

    def saved(self) -> Any:
        """The state as a checkpoint holds it: a tensor (torch's), lists and dicts of plain
        numbers (Python's, NumPy's)."""
        if isinstance(self.generator, torch.Generator):
            return self.state.clone()
        if isinstance(self.generator, random.Random):
            version, internal, gauss = self.state
            return [version, list(internal), gauss]
        return _plain(self.state)  # NumPy's: a dict of numbers and arrays

    def resumed(self, saved: Any) -> RandomState:
        """This generator at a ``saved`` state (:meth:`saved`)."""
        if isinstance(self.generator, random.Random):
            version, internal, gauss = saved
            return RandomState(self.generator, (version, tuple(internal), gauss))
        if isinstance(self.generator, torch.Generator):
            return RandomState(self.generator, saved.clone())
        return RandomState(self.generator, _like(saved, self.state))


def _plain(state: Any) -> Any:
    """A NumPy generator's state with its arrays and NumPy numbers as lists and numbers."""
    if isinstance(state, dict):
        return {k: _plain(v) for k, v in state.items()}
    return state.tolist() if hasattr(state, "tolist") else state


def _like(saved: Any, built: Any) -> Any:
    """``saved`` (:func:`_plain`) with arrays where ``built`` (a state) has them."""
    if isinstance(built, dict) and isinstance(saved, dict):
        return {k: _like(v, built.get(k)) for k, v in saved.items()}
    if hasattr(built, "shape") and hasattr(built, "dtype"):  # a NumPy array
        return _array(saved, built)
    return saved


def _array(values: Any, like: Any) -> Any:
    import numpy

    return numpy.asarray(values, dtype=like.dtype)


def generator(value: Any) -> bool:
    """Whether ``value`` is a random generator :class:`RandomState` holds."""
    if isinstance(value, random.SystemRandom):
        return False  # no state (the OS's): held as itself
    if isinstance(value, torch.Generator | random.Random):
        return True
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(
        value, numpy.random.RandomState | numpy.random.Generator
    )


def _state(gen: Any) -> Any:
    if isinstance(gen, torch.Generator):
        return gen.get_state()
    if isinstance(gen, random.Random):
        return gen.getstate()
    if hasattr(gen, "bit_generator"):  # NumPy's Generator
        return copy.deepcopy(gen.bit_generator.state)
    return gen.get_state(legacy=False)  # NumPy's RandomState


def _set_state(gen: Any, state: Any) -> None:
    if isinstance(gen, torch.Generator):
        gen.set_state(state)
    elif isinstance(gen, random.Random):
        gen.setstate(state)
    elif hasattr(gen, "bit_generator"):
        gen.bit_generator.state = copy.deepcopy(state)
    else:
        gen.set_state(copy.deepcopy(state))


def _same_state(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and bool(torch.equal(a, b))
    if isinstance(a, dict):
        return (
            isinstance(b, dict)
            and a.keys() == b.keys()
            and all(_same_state(v, b[k]) for k, v in a.items())
        )
    if isinstance(a, list | tuple):
        return (
            isinstance(b, list | tuple)
            and len(a) == len(b)
            and all(_same_state(x, y) for x, y in zip(a, b, strict=True))
        )
    if hasattr(a, "shape") and hasattr(a, "tolist"):  # a NumPy array
        return hasattr(b, "tolist") and bool(a.tolist() == b.tolist())
    return bool(a == b)


def hold(value: Any, own: Own, depth: int = 0) -> Any:
    """``value`` as it is now, to compare (:func:`~worker.module_state.same_value`) and to put
    back (:func:`put`); ``own``: whether a class is the user's."""
    if generator(value):
        return RandomState(value, _state(value))
    if isinstance(value, dict | list | set | tuple | frozenset) and len(value) > MAX_FIELDS:
        # data (a list of files, a vocabulary), not settings: not copied
        return Same(value) if isinstance(value, dict | list | set) else value
    held = held_value(value)
    if held is not value:
        return held  # plain: a copy; a small tensor: a snapshot
    if depth < MAX_DEPTH:
        if isinstance(value, dict | list):
            items = value.items() if isinstance(value, dict) else enumerate(value)
            return Fields(value, {k: hold(v, own, depth + 1) for k, v in items})
        if settings_object(value, own) and len(fields := attributes_of(value)) <= MAX_FIELDS:
            return Fields(value, {k: hold(v, own, depth + 1) for k, v in fields.items()})
    return Same(value) if isinstance(value, dict | list | set) else value


def settings_object(value: Any, own: Own) -> bool:
    """Whether ``value`` is a settings object, held field by field: a namespace, or an
    object of the user's own classes (``own``) with attributes."""
    if isinstance(value, _NAMESPACES):
        return True
    return (
        own(type(value))
        and (hasattr(value, "__dict__") or bool(_slots(type(value))))
        and not isinstance(value, _NOT_SETTINGS)
        and not isinstance(value, torch.Tensor)
    )


def _slots(cls: type) -> tuple[str, ...]:
    """The attributes ``cls``'s ``__slots__`` (and its bases') declare."""
    names: list[str] = []
    for klass in cls.__mro__:
        declared = vars(klass).get("__slots__", ())
        for declared_name in (declared,) if isinstance(declared, str) else declared:
            name = _mangled(klass, declared_name)
            if name not in ("__dict__", "__weakref__") and name not in names:
                names.append(name)
    return tuple(names)


def _mangled(klass: type, name: str) -> str:
    """The attribute a slot ``name`` of ``klass`` is stored as (``__x``: ``_Klass__x``)."""
    if name.startswith("__") and not name.endswith("__"):
        return f"_{klass.__name__.lstrip('_')}{name}"
    return name


def attributes_of(obj: Any) -> dict[str, Any]:
    """``obj``'s attributes: its ``__dict__``'s and those its class's ``__slots__`` hold (a
    ``@dataclass(slots=True)``'s fields), the unset ones left out."""
    fields = dict(vars(obj)) if hasattr(obj, "__dict__") else {}
    for name in _slots(type(obj)):
        value = getattr(obj, name, MISSING)
        if value is not MISSING:
            fields.setdefault(name, value)
    return fields


def _fill_object(obj: Any, held: dict[str, Any]) -> None:
    """Set ``obj``'s attributes back to ``held`` (:func:`attributes_of`), through
    ``object.__setattr__`` as a frozen dataclass's own ``__init__`` does."""
    current = attributes_of(obj)
    for name in [n for n in current if n not in held]:
        object.__delattr__(obj, name)
    for name, value in held.items():
        now = current.get(name, MISSING)
        new = put(now, value)
        if new is not now:
            object.__setattr__(obj, name, new)


def put(current: Any, held: Any) -> Any:
    """What to set where ``current`` is for it to hold ``held`` again: ``current`` itself,
    changed in place, where it can be (the same settings object, a dict, list or set of the
    same type, a tensor of the same shape), so that whoever else holds it sees the value."""
    if isinstance(held, Fields | RandomState):
        return held.put()
    if isinstance(held, Same):
        return held.obj
    if isinstance(held, Snapshot | ArraySnapshot):
        return held.restore(current)
    if type(current) is type(held):
        if isinstance(held, dict):
            _fill_dict(current, held)
            return current
        if isinstance(held, list):
            _fill_list(current, held)
            return current
        if isinstance(held, set):
            current.clear()
            current.update(held)
            return current
    return held_plain(held)  # a copy of a plain value (its training changes the copy)


def _fill_list(target: list[Any], held: list[Any]) -> None:
    target[:] = [put(target[i] if i < len(target) else MISSING, v) for i, v in enumerate(held)]


def _fill_dict(target: dict[Any, Any], held: dict[Any, Any]) -> None:
    for key in [k for k in target if k not in held]:
        del target[key]
    for key, value in held.items():
        current = target.get(key, MISSING)
        new = put(current, value)
        if new is not current:
            target[key] = new
