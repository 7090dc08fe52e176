"""Values a workload keeps outside its model and its workload object: globals of the
modules its classes and its model's come from, and those classes' own attributes
(``SCALE = cfg["scale"]`` or ``Net.scale = cfg["scale"]`` in ``build_model``, read in a
forward). A worker process has one of each, which every model in it reads: packed, a trial
would train with the value of the last trial built.

Each member's build is read before and after (:func:`reading`). A name some build in this
process changed is *kept outside* from then on (:func:`learn`, :func:`kept`): each member
holds its own value of it, put back (:func:`put_back`) before each of its stack's steps and
evaluations while no other array of the process steps (the exclusive side of
``worker.rng.GLOBAL_RNG``), and members whose values differ train one per stack. Each
member's build starts from the values before the process's first build (:func:`fresh`), as
a fresh process's would: a value a build sets for some trials only is, for the others, the
module's own, not the last build's. Values are
held and put back as :mod:`worker.outside_values` says: by value, a settings object or a
dict changed in place included, and put back in place; a copy of the model keeps holding
them (:func:`copy_model`). Modules and classes of torch and of packtune itself are not read.
"""

from __future__ import annotations

import copy
import os
import sys
import types
import weakref
from collections.abc import Container, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from worker.module_state import (
    MISSING,
    SMALL_TENSOR,
    ArraySnapshot,
    Snapshot,
    changed_state,
    checkpointable,
    held_value,
    number_array,
    same_value,
    versioned,
)
from worker.outside_values import (
    MAX_DEPTH,
    MAX_FIELDS,
    Fields,
    Own,
    RandomState,
    attributes_of,
    hold,
    put,
    settings_object,
)

#: top-level packages whose modules and classes are not read (their state is their own)
_NOT_READ = frozenset({"builtins", "torch", "packtune", "worker", "service", "abc", "typing"})
#: what a class holds that is code, not a value
_CODE = (types.FunctionType, staticmethod, classmethod, property)

Namespace = type | types.ModuleType
#: each namespace's names and their values at one moment (plain values copied)
Reading = dict[Namespace, dict[str, Any]]

#: the names that builds in this process changed, per namespace
_KEPT: weakref.WeakKeyDictionary[Namespace, frozenset[str]] = weakref.WeakKeyDictionary()
#: the names that builds in this process changed within a build (read before and after it),
#: per namespace: those :func:`fresh` puts back (not a name the program itself changed
#: between builds: a notebook's or a script's own variable)
_BUILT: weakref.WeakKeyDictionary[Namespace, frozenset[str]] = weakref.WeakKeyDictionary()
#: the names a training forward and loss changed (a counter a forward keeps in a module
#: global), per namespace, as a probe saw (:func:`learn_trained`): those :func:`fresh` puts
#: back too, since a trial alone starts its training from the module's value
_TRAINED: weakref.WeakKeyDictionary[Namespace, frozenset[str]] = weakref.WeakKeyDictionary()
#: each namespace as the last build in this process left it
_LAST: weakref.WeakKeyDictionary[Namespace, dict[str, Any]] = weakref.WeakKeyDictionary()
#: each namespace's values before any build in this process changed them (read before the
#: first build that reads it): where a fresh process's build starts from (:func:`fresh`)
_START: weakref.WeakKeyDictionary[Namespace, dict[str, Any]] = weakref.WeakKeyDictionary()
#: per namespace, each name's dict, list or set that the last build setting one anew set
#: there, and the object before the first of such builds in a row: where :func:`fresh` puts
#: the name back (never filling a container a build set: a table's entry)
_SET_ANEW: weakref.WeakKeyDictionary[Namespace, dict[str, tuple[Any, Any]]] = (
    weakref.WeakKeyDictionary()
)
#: the objects each namespace held as last read that a model may hold too (a dict, a list,
#: a settings object): a copy of the model keeps them shared (:func:`copy_model`)
_SHARED: weakref.WeakKeyDictionary[Namespace, list[Any]] = weakref.WeakKeyDictionary()
#: the workload objects of the arrays alive (a model may hold one: a bound method of it)
_WORKLOADS: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
#: per namespace, the names of larger tensors (over :data:`SMALL_TENSOR` elements) that a
#: build in this process changed in place: held by value from then on, as a small one is
#: (:func:`held_large`)
_HELD_LARGE: weakref.WeakKeyDictionary[Namespace, frozenset[str]] = weakref.WeakKeyDictionary()
#: the most elements of a larger tensor that a build may change in place and have held per
#: member (copied before each build, and per member after it); a larger one is only noted
MAX_HELD_LARGE = 1 << 22


def _read(module_name: str) -> bool:
    return module_name.split(".")[0] not in _NOT_READ


def namespaces(workload: Any, model: nn.Module | None = None) -> list[Namespace]:
    """Where ``workload`` (and ``model``) may keep values: the classes of the workload and
    of the model's modules and their bases, the modules that define them and the modules of
    theirs those import (``from my_plugin import knobs``: the same package, or beside them),
    and the classes these modules define (``Knobs.scale``), torch's and packtune's left out."""
    roots = (
        [type(workload), *(type(m) for m in model.modules())]
        if model is not None
        else [type(workload)]
    )
    classes = {cls: None for root in roots for cls in root.__mro__ if _read(cls.__module__)}
    modules: dict[types.ModuleType, None] = {}
    for cls in list(classes):
        module = sys.modules.get(cls.__module__)
        if module is not None and module not in modules:
            modules[module] = None
            modules.update(dict.fromkeys(_own_imports(module)))
    for module in modules:
        for value in list(vars(module).values()):
            if isinstance(value, type) and value.__module__ == module.__name__:
                classes.setdefault(value, None)
    return [*modules, *classes]


#: how many imports away from a workload's (or its model's) module :func:`_own_imports`
#: follows the user's modules (a factory's module that imports the model's layers: 2)
IMPORT_DEPTH = 3


def _own_imports(module: types.ModuleType) -> list[types.ModuleType]:
    """The modules of the user's as ``module`` is (of its top-level package, or files in its
    folder: a plugin of single files) that it imports: as modules (``from my_plugin import
    knobs``), or a class or function of theirs (``from my_plugin.models import make_net``:
    a module whose globals the factory may set before its first build is read); and those
    these import in turn, up to :data:`IMPORT_DEPTH` imports away (the factory's module may
    set a global of the layers' module it imports)."""
    out: dict[types.ModuleType, None] = {}
    level = [module]
    for _ in range(IMPORT_DEPTH):
        found = [
            other
            for current in level
            for other in _imports_of(current)
            if other is not module and other not in out and _home(module, other)
        ]
        out.update(dict.fromkeys(found))
        level = list(dict.fromkeys(found))
    return list(out)


def _imports_of(module: types.ModuleType) -> list[types.ModuleType]:
    """The modules ``module`` imports, as modules or through a class or function of theirs."""
    out: list[types.ModuleType] = []
    for value in list(vars(module).values()):
        if isinstance(value, types.ModuleType):
            other: types.ModuleType | None = value
        elif isinstance(value, type | types.FunctionType):
            other = sys.modules.get(getattr(value, "__module__", None) or "")
        else:
            continue
        if other is not None and other is not module:
            out.append(other)
    return out


def _home(module: types.ModuleType, other: types.ModuleType) -> bool:
    """Whether ``other`` is the user's as ``module`` is: of its top-level package, or a file
    in its folder (a plugin of single files)."""
    package, folder = module.__name__.split(".")[0], _folder(module)
    return _read(other.__name__) and (
        (package != "__main__" and other.__name__.split(".")[0] == package)
        or (folder is not None and _folder(other) == folder)
    )


def _folder(module: types.ModuleType) -> str | None:
    path = getattr(module, "__file__", None)
    return os.path.dirname(os.path.abspath(path)) if isinstance(path, str) else None


def reading(spaces: Iterable[Namespace]) -> Reading:
    """Every value of ``spaces`` now (dunder names, a class's methods, and a package's own
    submodules left out: one appears as the package's attribute when first imported, inside
    a build or a forward too, and is never a value to put back; a module a build sets a
    global to, ``IMPL = impl_b``, is one)."""
    out: Reading = {}
    for space in spaces:
        own = _own(space)
        values = {
            name: value
            for name, value in list(vars(space).items())
            if not (name.startswith("__") and name.endswith("__"))
            and not (isinstance(space, type) and isinstance(value, _CODE))
            and not _submodule(space, name, value)
        }
        out[space] = {name: _held(space, name, value, own) for name, value in values.items()}
        _SHARED[space] = [
            value
            for name, value in values.items()
            if isinstance(value, dict | list | set) or isinstance(out[space][name], Fields)
        ]
    return out


def _held(space: Namespace, name: str, value: Any, own: Own) -> Any:
    """``space``'s ``value`` at ``name`` held (:func:`hold`; a larger tensor or array by
    value where builds or steps change it: :data:`_HELD_LARGE`)."""
    if name in _HELD_LARGE.get(space, frozenset()):
        return _snapshot(value)
    return hold(value, own)


def _snapshot(value: Any) -> Any:
    """A larger tensor or NumPy array held by value (:data:`_HELD_LARGE`), as a small one is."""
    if isinstance(value, Tensor) and versioned(value):
        return Snapshot(value.detach().clone(), value)
    if number_array(value):
        return ArraySnapshot(value.copy(), value)
    return hold(value, lambda cls: False)


#: before a build, each larger tensor or NumPy array it might change in place: its namespace
#: and name -> (the object, a tensor's version (None: an array's), a copy of its values)
Copies = dict[tuple[Namespace, str], tuple[Any, int | None, Any]]


def large_copies(spaces: Iterable[Namespace]) -> Copies:
    """Before a build: a copy of each larger tensor or NumPy array of numbers (up to
    :data:`MAX_HELD_LARGE` elements) that ``spaces`` hold by name and do not hold by value
    yet, for :func:`held_large`."""
    out: Copies = {}
    for space in spaces:
        held = _HELD_LARGE.get(space, frozenset())
        for name, value in list(vars(space).items()):
            if name in held or not _large_held(value):
                continue
            if isinstance(value, Tensor):
                out[space, name] = (value, value._version, value.detach().clone())
            else:
                out[space, name] = (value, None, value.copy())
    return out


def held_large(before: Reading, copies: Copies) -> None:
    """After a build: the tensors and arrays of ``copies`` it changed in place are held by
    value from now on (:func:`reading`), their values before it put into ``before`` (the
    build's reading before it, which :func:`learn` compares) and, where no build in this
    process changed them yet, into the values a fresh process's build starts from
    (:func:`fresh`)."""
    for (space, name), (obj, version, values) in copies.items():
        was = Snapshot(values, obj) if version is not None else ArraySnapshot(values, obj)
        unchanged = obj._version == version if version is not None else was.same_as(obj)
        if unchanged or vars(space).get(name) is not obj:
            continue
        _keep(_HELD_LARGE, space, {name})
        start = _START.get(space)
        if start is not None and name in start and start[name] is obj:
            start[name] = was  # (held as itself until now)
        if space in before:
            before[space][name] = was


def settle(reading: Reading) -> None:
    """Hold by value, in a member's ``reading``, the larger tensors held as themselves there
    that are held by value since it was taken (a probe saw a training step change them in
    place), at their values now: those its build left (a build that changed one would have
    been seen as it ran)."""
    for space, values in reading.items():
        for name in _HELD_LARGE.get(space, frozenset()) & values.keys():
            if values[name] is vars(space).get(name, MISSING):
                values[name] = _snapshot(values[name])


def _submodule(space: Namespace, name: str, value: Any) -> bool:
    """Whether ``value`` is package ``space``'s own submodule ``name`` (``pkg.extra``)."""
    return (
        isinstance(value, types.ModuleType)
        and isinstance(space, types.ModuleType)
        and value.__name__ == f"{space.__name__}.{name}"
    )


def fresh(spaces: Iterable[Namespace]) -> Reading:
    """Put the names of ``spaces`` that builds changed back to their values before any build
    in this process, and read the spaces (:func:`reading`): a member's build then starts
    from what a fresh process's would, not from what an earlier build set (a value its
    build sets only for some trials). A namespace first read after a build (not read
    before any: its values then unknown) is left as it is."""
    spaces = list(spaces)
    for space in spaces:
        start = _START.get(space)
        names = _BUILT.get(space, frozenset()) | _TRAINED.get(space, frozenset())
        if start is not None and names:
            # a dict a build set there (a table's entry, an earlier member's) is not filled
            # with the start: the one before it is put back there, and filled
            for name, (made, restore) in list(_SET_ANEW.get(space, {}).items()):
                if name in names and vars(space).get(name, MISSING) is made:
                    setattr(space, name, restore)
            _put_into(space, {name: start.get(name, MISSING) for name in names})
    out = reading(spaces)
    for space, values in out.items():
        if space not in _START and space not in _LAST:
            _START[space] = dict(values)
    return out


#: the dicts, lists and sets of namespaces by where they are, at one moment (the objects)
Containers = dict[tuple[Namespace, str], Any]


def containers(spaces: Iterable[Namespace]) -> Containers:
    """The dicts, lists and sets ``spaces`` hold now, by namespace and name."""
    return {
        (space, name): value
        for space in spaces
        for name, value in list(vars(space).items())
        if isinstance(value, dict | list | set)
    }


def note_set_anew(before: Containers, after: Containers) -> None:
    """After a build: the containers it set anew (another object ``after`` it than
    ``before`` it, where one was known: :func:`containers`), for :func:`fresh` and
    :func:`set_anew`."""
    for (space, name), value in after.items():
        if (space, name) not in before or before[space, name] is value:
            continue
        was = before[space, name]
        last = _SET_ANEW.get(space, {}).get(name)
        restore = last[1] if last is not None and was is last[0] else was
        _SET_ANEW.setdefault(space, {})[name] = (value, restore)


def paired(obj: Any, target: Any, depth: int = 0) -> dict[int, Any]:
    """``obj`` (a dict, list or set a build set) and the containers within it, by id, each
    to the one at its place in ``target`` (of the same shape), where there is one: what a
    copy of a model that holds them holds instead (:func:`copy_model`'s ``shared_as``)."""
    out: dict[int, Any] = {id(obj): target}
    if depth < MAX_DEPTH and isinstance(obj, dict) and isinstance(target, dict):
        pairs = [(v, target[k]) for k, v in obj.items() if k in target]
    elif depth < MAX_DEPTH and isinstance(obj, list) and isinstance(target, list):
        pairs = list(zip(obj, target, strict=False))
    else:
        pairs = []
    for inner, there in pairs:
        if isinstance(inner, dict | list | set) and type(inner) is type(there):
            out.update(paired(inner, there, depth + 1))
    return out


def set_anew(space: Namespace, name: str) -> Any:
    """The container the last build that set one anew at ``name`` set there (None: none)."""
    last = _SET_ANEW.get(space, {}).get(name)
    return last[0] if last is not None else None


#: a larger tensor kept outside the model, by where it is: (the tensor, its version)
Versions = dict[str, tuple[Tensor, int]]


def large_tensors(spaces: Iterable[Namespace]) -> Versions:
    """The tensors of ``spaces`` too large to be held by value (more than
    :data:`~worker.module_state.SMALL_TENSOR` elements; an ``nn.Module``'s parameters and
    buffers, whatever their size), at a settings object's, dict's or list's first level too,
    with their version counters (which an in-place change moves): :func:`changed_in_place`
    compares two such readings."""
    out: Versions = {}
    for space in spaces:
        own = _own(space)
        held = _HELD_LARGE.get(space, frozenset())
        for name, value in list(vars(space).items()):
            if (name.startswith("__") and name.endswith("__")) or name in held:
                continue  # (one held by value: its changes are read as a small one's)
            _large(label(space, name), value, own, out, depth=0)
    return out


def _large(where: str, value: Any, own: Own, out: Versions, depth: int) -> None:
    if isinstance(value, Tensor):
        if versioned(value) and value.numel() > SMALL_TENSOR:  # (a lazy one has no numel)
            out[where] = (value, value._version)
    elif isinstance(value, nn.Module):
        for name, tensor in [*value.named_parameters(), *value.named_buffers()]:
            if versioned(tensor):
                out[f"{where}.{name}"] = (tensor, tensor._version)
    elif depth == 0 and isinstance(value, dict | list | tuple) and len(value) <= MAX_FIELDS:
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in list(items):
            _large(f"{where}[{key!r}]", item, own, out, depth + 1)
    elif depth == 0 and settings_object(value, own):
        for key, item in attributes_of(value).items():
            _large(f"{where}.{key}", item, own, out, depth + 1)


def changed_in_place(before: Versions, after: Versions) -> list[str]:
    """Where the same larger tensor changed in place between ``before`` and ``after``
    (:func:`large_tensors`): a value packtune cannot hold per trial."""
    return sorted(
        where
        for where, (tensor, version) in after.items()
        if where in before and before[where][0] is tensor and before[where][1] != version
    )


def undo(before: Reading, only: Mapping[Namespace, Iterable[str]] | None = None) -> None:
    """Put the names of ``before``'s namespaces that changed since that reading (of them,
    those ``only`` names where given) back to its values (names new since then removed): a
    build that leaves no trace (``packtune check``'s own), a probe's forwards."""
    now = reading(before)
    for space, values in before.items():
        names = changed_state(values, now[space])
        if only is not None:
            names = [n for n in names if n in set(only.get(space, ()))]
        if names:
            _put_into(space, {name: values.get(name, MISSING) for name in names})


def _own(space: Namespace) -> Own:
    """Whether a class is the user's as ``space`` is (:func:`_home`): its instances are
    settings, held field by field."""
    module = space if isinstance(space, types.ModuleType) else sys.modules.get(space.__module__)

    def own(cls: type) -> bool:
        home = sys.modules.get(cls.__module__)
        return module is not None and home is not None and _home(module, home)

    return own


def copy_model(model: nn.Module, shared_as: Mapping[int, Any] | None = None) -> nn.Module:
    """A deep copy of ``model`` that still holds the objects of the namespaces read in this
    process (``self.settings = SETTINGS``) and the arrays' workload objects and their
    attributes' (a model holding ``workload.noise``, a bound method, or
    ``workload.settings``): what :func:`put_back` and :func:`put_attributes` put into them,
    its forward reads, as the model's own does. ``shared_as``: objects (by id) the copy holds
    another in place of (a dict a member's build set anew: the one a name holds now)."""
    memo = {id(obj): obj for objs in list(_SHARED.values()) for obj in objs}
    memo.update(shared_as or {})
    for workload in list(_WORKLOADS.values()):
        memo[id(workload)] = workload
        for value in list(vars(workload).values()):  # its settings object, its generator
            if not isinstance(value, Tensor | nn.Module):  # those a copy must not share
                memo[id(value)] = value
    return copy.deepcopy(model, memo)


def share(workload: Any) -> None:
    """Keep ``workload`` (an array's workload object) shared by :func:`copy_model`."""
    try:
        _WORKLOADS[id(workload)] = workload
    except TypeError:  # no weak reference to it (__slots__): copies of models copy it
        pass


def learn(before: Reading, after: Reading) -> set[tuple[Namespace, str]]:
    """Note what a build changed: the names whose values ``after`` it differ from those
    ``before`` it, or from those the last build in this process left (returned; a draw a
    forward made from a generator since, say)."""
    out: set[tuple[Namespace, str]] = set()
    for space, values in after.items():
        built = changed_state(before[space], values) if space in before else set()
        if built:
            _keep(_BUILT, space, built)
        changed = set(built)
        if space in _LAST and _module_name(space) != "__main__":
            # (a script's or a notebook's own variables change between builds: not state)
            changed.update(changed_state(_LAST[space], values))
        if changed:
            _keep(_KEPT, space, changed)
            out.update((space, name) for name in changed)
        _LAST[space] = dict(values)  # not the member's reading, which its training updates
    return out


def learn_trained(before: Reading, after: Reading) -> dict[Namespace, set[str]]:
    """Note what training forwards changed (a probe's, read ``before`` and ``after`` them):
    each member's own from now on, as what a build changed is, whatever module it is in (a
    script's too: the script does not run within a probe). A cache a forward fills on first
    use counts too: it cannot be told from a value computed from the model (a scale taken
    from the first batch's activations). Returns the names noted."""
    out: dict[Namespace, set[str]] = {}
    for space, values in after.items():
        changed = changed_state(before[space], values) if space in before else set()
        if changed:
            _keep(_TRAINED, space, changed)
            _keep(_KEPT, space, changed)
            out[space] = set(changed)
    return out


def holds_tensor(held: Any, depth: int = 0) -> bool:
    """Whether a held value is, or holds, a tensor (a snapshot of a small one, a larger one
    itself): one that a fused forward would set to its whole stack's batched value."""
    if isinstance(held, Snapshot | Tensor):
        return True
    if isinstance(held, Fields) and depth < 3:
        return any(holds_tensor(v, depth + 1) for v in held.fields.values())
    if isinstance(held, dict | list | tuple) and depth < 3:
        values = held.values() if isinstance(held, dict) else held
        return any(holds_tensor(v, depth + 1) for v in values)
    return False


def _keep(
    table: weakref.WeakKeyDictionary[Any, frozenset[str]], key: Any, names: Iterable[str]
) -> None:
    """Add ``names`` to ``key``'s kept names in ``table`` (:data:`_KEPT`, or the workload
    attributes')."""
    table[key] = table.get(key, frozenset()) | frozenset(names)


def kept(spaces: Iterable[Namespace]) -> dict[Namespace, frozenset[str]]:
    """The names of ``spaces`` a build in this process changed (another array's build may
    add to them at any time)."""
    return {space: names for space in spaces if (names := _KEPT.get(space))}


def values_of(
    built: Reading, names: Mapping[Namespace, frozenset[str]]
) -> dict[Namespace, dict[str, Any]]:
    """A member's values (``built``: its reading after its build) of the kept ``names``."""
    return {
        space: {name: built[space].get(name, MISSING) for name in sorted(spaces_names)}
        for space, spaces_names in names.items()
        if space in built
    }


def differing(
    readings: Iterable[Reading],
    names: Mapping[Namespace, frozenset[str]],
    seeded: Container[tuple[Namespace, str]] = (),
) -> list[str]:
    """The kept ``names`` whose values differ between members (``readings``: each one's
    after its build), as ``module.NAME`` or ``module.Class.name``. A random generator that
    the members' builds changed (``seeded``: ``GEN.manual_seed(...)``, or draws since the
    last build) differs even at equal states: each member alone draws from its own copy of
    the state, which members stacked together would share."""
    first, *rest = list(readings)
    return [
        label(space, name)
        for space, space_names in names.items()
        for name in sorted(space_names)
        if any(
            not same_value(value := first.get(space, {}).get(name, MISSING),
                           r.get(space, {}).get(name, MISSING))
            or (isinstance(value, RandomState) and (space, name) in seeded)
            for r in rest
        )
    ]  # fmt: skip


def _module_name(space: Namespace) -> str:
    return space.__name__ if isinstance(space, types.ModuleType) else space.__module__


def label(space: Namespace, name: str) -> str:
    where = (
        space.__name__
        if isinstance(space, types.ModuleType)
        else (f"{space.__module__}.{space.__qualname__}")
    )
    return f"{where}.{name}"


def put_back(values: Mapping[Namespace, Mapping[str, Any]]) -> None:
    """Set each namespace's names to ``values`` (:data:`MISSING`: deleted), in place where
    the object there can take them (:func:`worker.outside_values.put`)."""
    for space, names in values.items():
        _put_into(space, names)


def _put_into(obj: Any, values: Mapping[str, Any]) -> None:
    """Set ``obj``'s attributes to held ``values`` (:data:`MISSING`: deleted), in place where
    the object there can take them."""
    for name, value in values.items():
        current = vars(obj).get(name, MISSING)
        if value is MISSING:
            if current is not MISSING:
                delattr(obj, name)
            continue
        new = put(current, value)
        if new is not current:
            setattr(obj, name, new)


def now(values: Mapping[Namespace, Mapping[str, Any]]) -> dict[Namespace, dict[str, Any]]:
    """The current values of the names of ``values`` (what training made of them)."""
    return {
        space: {name: _held_now(space, name) for name in names} for space, names in values.items()
    }


def _held_now(space: Namespace, name: str) -> Any:
    return _held(space, name, vars(space).get(name, MISSING), _own(space))


def saved(values: Mapping[Namespace, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """A member's ``values`` of the kept names as its checkpoint holds them, by
    :func:`label` (:func:`saved_value`)."""
    return {
        label(space, name): entry
        for space, names in values.items()
        for name, held in names.items()
        if (entry := saved_value(held)) is not None
    }


def saved_value(held: Any) -> dict[str, Any] | None:
    """A held value as a checkpoint holds it: ``{"value": v}`` (a number, string, container
    of them, small tensor), ``{"fields": {...}}`` (a settings object's or dict's such
    fields) or ``{"rng": state}`` (a random generator's); None where a
    checkpoint cannot hold it (a trial resumed starts it from build_model's value)."""
    if isinstance(held, Fields):
        fields = {k: v for k, f in held.fields.items() if (v := _savable(f)) is not MISSING}
        ok = fields and all(isinstance(k, str) for k in fields)
        return {"fields": fields} if ok else None
    if isinstance(held, RandomState):
        state = held.saved()
        return {"rng": state} if state is not None else None
    value = _savable(held)
    return {"value": value} if value is not MISSING else None


def _savable(held: Any) -> Any:
    if isinstance(held, Snapshot):
        return held.tensor.detach().to("cpu", copy=True)
    if isinstance(held, ArraySnapshot):  # as a tensor, which a checkpoint reads back
        try:
            return torch.from_numpy(held.copy())
        except (TypeError, ValueError):  # a dtype torch has not (longdouble, byte-swapped)
            return MISSING
    return copy.deepcopy(held) if held is not MISSING and checkpointable(held) else MISSING


def resumed_value(held: Any, entry: Mapping[str, Any]) -> Any:
    """``held`` (a value after a resumed member's build) with its checkpoint's ``entry``
    (:func:`saved_value`) in place of the build's."""
    if "value" in entry:
        return _resumed(held, entry["value"])
    if "rng" in entry and isinstance(held, RandomState):
        return held.resumed(entry["rng"])
    if "fields" in entry and isinstance(held, Fields):
        fields = {k: _resumed(held.fields.get(k, MISSING), v) for k, v in entry["fields"].items()}
        return Fields(held.obj, {**held.fields, **fields})
    return held


def _resumed(held: Any, value: Any) -> Any:
    """A saved ``value`` held as the build's ``held`` was: a small tensor or NumPy array (saved
    as a tensor, on the CPU) as a snapshot of the object the build's was read from, put back
    into it."""
    if isinstance(value, Tensor) and isinstance(held, Snapshot):
        return Snapshot(value.to(held.tensor.device), held.source)
    if isinstance(value, Tensor) and isinstance(held, ArraySnapshot):
        return ArraySnapshot(value.numpy().astype(held.array.dtype), held.source)
    if isinstance(value, Tensor) and _large_held(held):
        # a larger one this process has not seen changed yet (a training step changes it:
        # its probe comes after the builds), held as itself: put back into it, as there
        if isinstance(held, Tensor):
            return Snapshot(value.to(held.device, held.dtype), held)
        return ArraySnapshot(value.numpy().astype(held.dtype), held)
    return held_value(value)


def _large_held(held: Any) -> bool:
    """Whether ``held`` is a larger tensor or NumPy array of numbers, held as itself."""
    if isinstance(held, Tensor):
        return versioned(held) and SMALL_TENSOR < held.numel() <= MAX_HELD_LARGE
    return number_array(held) and SMALL_TENSOR < held.size <= MAX_HELD_LARGE


def resume(reading: Reading, saved: Mapping[str, Mapping[str, Any]]) -> None:
    """A resumed member's ``reading`` after its build, with the values its checkpoint saved
    (:func:`saved`) in place of the build's, their names kept from now on."""
    for space, values in reading.items():
        for name in list(values):
            entry = saved.get(label(space, name))
            if entry is not None:
                if _large_held(values[name]) and isinstance(entry.get("value"), Tensor):
                    _keep(_HELD_LARGE, space, {name})  # by value from now on, as it was saved
                    start = _START.get(space)
                    if start is not None and start.get(name) is values[name]:
                        start[name] = _snapshot(values[name])  # (as the build left it)
                values[name] = resumed_value(values[name], entry)
                _keep(_KEPT, space, {name})


# -- the workload object's own attributes, changed in place ------------------------------
#
# A workload object's attributes set anew per trial (``self.smoothing = ...``) are each
# member's own already (:func:`worker.fusion_guard.workload_differences`). One changed in
# place (``self.settings.scale = ...``, ``self.gen.manual_seed(...)``) is the same object in
# every member, and in every array of the process (each array's workload is a shallow copy
# of one): such attributes are held and put back as the values above are.

#: per workload class, the attributes that builds in this process changed in place
_KEPT_ATTRIBUTES: weakref.WeakKeyDictionary[type, frozenset[str]] = weakref.WeakKeyDictionary()


#: the objects of workload attributes (:func:`attributes`) as first held, before any build
#: in this process changed them, by the object's ``id`` (the object kept with it, so that
#: the id is not another's): where a fresh process's build finds them
_START_OBJECTS: dict[int, tuple[Any, Any]] = {}


def fresh_attributes(workload: Any) -> dict[str, Any]:
    """Put ``workload``'s attributes that builds changed in place (:func:`kept_attributes`)
    back to where they stood before any build in this process, and hold them
    (:func:`attributes`): a member's build starts from what a fresh process's would."""
    now = vars(workload)
    for name in kept_attributes(workload):
        start = _START_OBJECTS.get(id(now.get(name)))
        if start is not None and start[0] is now.get(name):
            _put_into(workload, {name: start[1]})
    held = attributes(workload)
    for name, value in held.items():
        obj = now[name]
        if id(obj) not in _START_OBJECTS:
            _START_OBJECTS[id(obj)] = (obj, value)
    return held


def attributes(workload: Any) -> dict[str, Any]:
    """``workload``'s attributes that a build may change in place (a settings object, a
    random generator, a dict, list or set), held."""
    own = _own(type(workload))
    out: dict[str, Any] = {}
    for name, value in list(vars(workload).items()):
        held = hold(value, own)
        if isinstance(held, Fields | RandomState) or isinstance(value, dict | list | set):
            out[name] = held
    return out


def learn_attributes(
    workload: Any, objects: Mapping[str, Any], before: Mapping[str, Any], after: Mapping[str, Any]
) -> set[str]:
    """Note the attributes a build of ``workload`` changed in place (returned): the same
    object as before it (``objects``: its ``vars()`` then), held (:func:`attributes`)
    differently. One set anew is :func:`worker.fusion_guard.workload_differences`' to
    compare."""
    now = vars(workload)
    changed = {
        name
        for name in changed_state(dict(before), dict(after))
        if name in objects and now.get(name, MISSING) is objects[name]
    }
    if changed:
        _keep(_KEPT_ATTRIBUTES, type(workload), changed)
    return changed


def differing_attributes(
    readings: Iterable[Mapping[str, Any]], changed: Container[str]
) -> list[str]:
    """The attributes (``readings``: each member's :func:`attributes` after its build) that
    builds changed in place whose values differ between members, or that are a random
    generator (which members stacked together would share)."""
    first, *rest = list(readings)
    return sorted(
        name
        for name in {n for r in [first, *rest] for n in r}
        if name in changed
        and (
            isinstance(first.get(name), RandomState)
            or any(not same_value(first.get(name, MISSING), r.get(name, MISSING)) for r in rest)
        )
    )


def resume_attributes(
    workload: Any, held: dict[str, Any], saved: Mapping[str, Mapping[str, Any]]
) -> None:
    """A resumed member's ``held`` attributes (:func:`attributes`, after its build) with the
    values its checkpoint saved (``python.workload_held``) in place of the build's, their
    names held from now on (as :func:`resume` does for values kept outside)."""
    for name, entry in saved.items():
        if name in held:
            held[name] = resumed_value(held[name], entry)
            _keep(_KEPT_ATTRIBUTES, type(workload), {name})


def kept_attributes(workload: Any) -> frozenset[str]:
    """The attributes of ``workload`` that builds in this process changed in place."""
    return _KEPT_ATTRIBUTES.get(type(workload), frozenset())


def put_attributes(workload: Any, values: Mapping[str, Any]) -> None:
    """Set ``workload``'s attributes to held ``values``, in place where they can take them."""
    _put_into(workload, values)
