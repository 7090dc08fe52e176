"""Search spaces: parsing, seeded sampling and fusion keys.

A study's ``space`` is JSON such as::

    {"lr": {"type": "loguniform", "low": 1e-4, "high": 0.3},
     "hidden": {"type": "choice", "values": [64, 128]},
     "layers": {"type": "int", "low": 1, "high": 4, "log": false}}

:func:`parse_space` turns it into :class:`Dimension` values or raises
:class:`~packtune.errors.SpecError` whose ``field`` is a dotted path such as
``space.lr.low``. The rules:

- ``uniform`` and ``loguniform`` need finite numbers with ``low < high``
  (``low == high`` is an empty range) and a finite ``high - low``; ``loguniform`` needs
  ``low > 0``.
- ``int`` needs integer bounds (``3.0`` is read as ``3``) within ±2**53 with ``low <= high``;
  ``low == high`` is a single value and allowed. ``log: true`` needs ``low >= 1``.
- ``choice`` needs a non-empty list of distinct JSON scalars (string, number,
  boolean, null), no two equal in Python (``1`` and ``1.0``, ``1`` and ``true``).
- Unknown keys in a dimension are rejected, as are empty parameter names.

Sampling is a pure function of ``(seed, index)``: the ``index``-th trial of a
study draws from its own ``random.Random`` seeded with a SHA-256 of
``"{seed}:{index}"``, parameters in sorted name order, so trial 7's config
does not depend on how many trials were sampled before it, nor on the machine.
Only ``Random.random()`` is used, the one method whose stream Python promises
to keep across versions; ``loguniform`` and ``int`` with ``log`` also go
through ``math.log``/``math.exp``.

A **fusion key** names the trials that can be trained as one fused array: the
workload name plus the canonical JSON of the config's structural values. In
that encoding an integral float is written as an int (``64.0`` -> ``64``), so
a batch size that arrived as a float from YAML or JSON does not split a group;
booleans stay booleans. Pass the workload-resolved config (defaults filled
in), so that an omitted default and an explicit one give the same key.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import random
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from packtune.errors import SpecError

Scalar = str | int | float | bool | None

#: values one ``choice`` may list (a spec is stored with every study and shown by the API)
MAX_CHOICES = 1_000
#: the largest magnitude of an int dimension's bounds: every integer up to it is a float too
MAX_INT = 2**53


@dataclass(frozen=True)
class Uniform:
    """A float drawn uniformly from ``[low, high]``."""

    low: float
    high: float

    def sample(self, rng: random.Random) -> float:
        u = rng.random()
        # Written as a weighted mean so that huge ranges cannot overflow.
        return min(self.high, max(self.low, self.low * (1.0 - u) + self.high * u))


@dataclass(frozen=True)
class LogUniform:
    """A float whose logarithm is uniform on ``[log(low), log(high)]``."""

    low: float
    high: float

    def sample(self, rng: random.Random) -> float:
        log_low, log_high = math.log(self.low), math.log(self.high)
        value = math.exp(log_low + (log_high - log_low) * rng.random())
        return min(self.high, max(self.low, value))


@dataclass(frozen=True)
class Int:
    """An integer in ``[low, high]``, both included; uniform, or uniform in log space."""

    low: int
    high: int
    log: bool = False

    def sample(self, rng: random.Random) -> int:
        u = rng.random()
        if not self.log:
            return min(self.high, self.low + math.floor(u * (self.high - self.low + 1)))
        # Each integer owns the log-interval around it, [v - 0.5, v + 0.5).
        log_low, log_high = math.log(self.low - 0.5), math.log(self.high + 0.5)
        value = math.floor(math.exp(log_low + (log_high - log_low) * u) + 0.5)
        return min(self.high, max(self.low, value))


@dataclass(frozen=True)
class Choice:
    """One of ``values``, each equally likely."""

    values: tuple[Scalar, ...]

    def sample(self, rng: random.Random) -> Scalar:
        index = min(len(self.values) - 1, math.floor(rng.random() * len(self.values)))
        return self.values[index]


Dimension = Uniform | LogUniform | Int | Choice

_KEYS = {
    "uniform": {"type", "low", "high"},
    "loguniform": {"type", "low", "high"},
    "int": {"type", "low", "high", "log"},
    "choice": {"type", "values"},
}


def parse_space(raw: Mapping[str, Any], prefix: str = "space") -> dict[str, Dimension]:
    """Validate a space's JSON form; errors name the field, e.g. ``space.lr.low``."""
    if not isinstance(raw, Mapping):
        raise SpecError(prefix, "must be a mapping of parameter name to dimension")
    space: dict[str, Dimension] = {}
    for name, spec in raw.items():
        if not isinstance(name, str) or not name.strip():
            raise SpecError(prefix, f"parameter names must be non-empty strings, got {name!r}")
        space[name] = parse_dimension(spec, f"{prefix}.{name}")
    return space


def parse_dimension(spec: Any, field: str) -> Dimension:
    """One dimension; ``field`` is its dotted path (``space.lr``)."""
    if not isinstance(spec, Mapping):
        raise SpecError(field, "must be a mapping with a 'type'")
    kind = spec.get("type")
    if not isinstance(kind, str) or kind not in _KEYS:
        raise SpecError(f"{field}.type", f"must be one of {sorted(_KEYS)}, got {kind!r}")
    unknown = sorted(str(key) for key in set(spec) - _KEYS[kind])
    if unknown:
        raise SpecError(f"{field}.{unknown[0]}", f"unknown key for a {kind} dimension")
    if kind == "choice":
        return Choice(_choice_values(spec.get("values"), f"{field}.values"))
    low = _number(spec, "low", field)
    high = _number(spec, "high", field)
    if low > high:
        raise SpecError(f"{field}.low", f"low ({low}) is greater than high ({high})")
    if kind == "int":
        log = spec.get("log", False)
        if not isinstance(log, bool):
            raise SpecError(f"{field}.log", "must be true or false")
        int_low, int_high = _integer(low, f"{field}.low"), _integer(high, f"{field}.high")
        for end, value in (("low", int_low), ("high", int_high)):
            if abs(value) > MAX_INT:
                raise SpecError(f"{field}.{end}", f"must be within ±2**53, got {_short(value)}")
        if log and int_low < 1:
            raise SpecError(f"{field}.low", "must be at least 1 for a log-scaled int")
        return Int(int_low, int_high, log)
    if low == high:
        raise SpecError(f"{field}.high", f"empty range: low and high are both {low}")
    if not math.isfinite(high - low):
        raise SpecError(f"{field}.high", f"the range {low} to {high} is too wide to sample")
    if kind == "loguniform":
        if low <= 0:
            raise SpecError(f"{field}.low", "must be greater than 0 for loguniform")
        return LogUniform(float(low), float(high))
    return Uniform(float(low), float(high))


def _number(spec: Mapping[str, Any], key: str, field: str) -> float:
    if key not in spec:
        raise SpecError(f"{field}.{key}", "is required")
    value = spec[key]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SpecError(f"{field}.{key}", f"must be a number, got {value!r}")
    if not _finite(value):
        raise SpecError(f"{field}.{key}", f"must be finite, got {_short(value)}")
    return value


def _finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond any float
        return False


def _short(value: float) -> str:
    """``value`` as written, or its first digits where it is long."""
    text = str(value)
    return text if len(text) <= 24 else f"{text[:8]}... ({len(text.lstrip('-'))} digits)"


def _integer(value: float, field: str) -> int:
    if isinstance(value, float) and not value.is_integer():
        raise SpecError(field, f"must be an integer, got {value!r}")
    return int(value)


def _choice_values(values: Any, field: str) -> tuple[Scalar, ...]:
    if not isinstance(values, list | tuple):
        raise SpecError(field, "must be a list")
    if not values:
        raise SpecError(field, "must not be empty")
    if len(values) > MAX_CHOICES:
        raise SpecError(field, f"has {len(values)} values; at most {MAX_CHOICES} are allowed")
    seen: set[str] = set()
    for position, value in enumerate(values):
        if value is not None and not isinstance(value, str | int | float):
            raise SpecError(f"{field}.{position}", f"must be a JSON scalar, got {value!r}")
        if isinstance(value, float) and not math.isfinite(value):
            raise SpecError(f"{field}.{position}", f"must be finite, got {value!r}")
        encoded = json.dumps(value)
        if encoded in seen:
            raise SpecError(f"{field}.{position}", f"duplicate value {value!r}")
        equal = [v for v in values[:position] if v == value]  # 1 and 1.0, 1 and true
        if equal:
            raise SpecError(
                f"{field}.{position}",
                f"{value!r} equals {equal[0]!r}, an earlier value: a sampler cannot tell "
                "them apart",
            )
        seen.add(encoded)
    return tuple(values)


def seeded_rng(label: str) -> random.Random:
    """A `random.Random` seeded by a SHA-256 of ``label``: the same stream on any machine."""
    digest = hashlib.sha256(label.encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def sample_config(space: Mapping[str, Dimension], seed: int, index: int) -> dict[str, Any]:
    """The config of the study's ``index``-th trial: same inputs, same config, anywhere."""
    rng = seeded_rng(f"{seed}:{index}")
    return {name: space[name].sample(rng) for name in sorted(space)}


def trial_seed(seed: int, index: int) -> int:
    """A non-negative 31-bit seed for the ``index``-th trial's model initialisation."""
    digest = hashlib.sha256(f"trial-seed:{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFF_FFFF


def split_config(
    config: Mapping[str, Any], structural: Collection[str]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(structural part, fusible part)`` of a config."""
    shape = {key: value for key, value in config.items() if key in structural}
    fusible = {key: value for key, value in config.items() if key not in structural}
    return shape, fusible


def canonical(value: Any) -> Any:
    """``value`` with integral floats as ints, tuples as lists, recursively."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list | tuple):
        return [canonical(item) for item in value]
    if isinstance(value, Mapping):
        return {str(key): canonical(item) for key, item in value.items()}
    return value


def fusion_key(workload: str, config: Mapping[str, Any], structural: Collection[str]) -> str:
    """``workload|{canonical JSON of the structural values}``, e.g.
    ``digits-mlp|{"batch_size":64,"hidden":128,"optimizer":"sgd"}``."""
    shape, _ = split_config(config, structural)
    # a study's thousands of trials share a few shapes (a tick samples thousands at once):
    # a shape of plain values is encoded once, each value's type in the memo's key, as
    # True == 1 == 1.0 in Python; nested values (where (True,) == (1,) too) each time
    if all(type(v) in _PLAIN for v in shape.values()):
        return _encoded(workload, tuple((k, type(v), v) for k, v in sorted(shape.items())))
    return _encode(workload, shape)


_PLAIN = frozenset({str, int, float, bool, type(None)})


@functools.lru_cache(maxsize=1024)
def _encoded(workload: str, shape: tuple[tuple[str, type, Any], ...]) -> str:
    return _encode(workload, {k: v for k, _, v in shape})


def _encode(workload: str, shape: Mapping[str, Any]) -> str:
    encoded = json.dumps(canonical(shape), sort_keys=True, separators=(",", ":"), allow_nan=False)
    return f"{workload}|{encoded}"
