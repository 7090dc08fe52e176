"""A spec's text read into values, where an integer is too long to read.

Python converts at most ``sys.get_int_max_str_digits()`` digits (4300 by default: longer
conversions take quadratic time) and raises ``ValueError`` past them, which told a client
that the whole body could not be parsed (a 400) or ended ``packtune run`` in a traceback.
Read here, such an integer is a :class:`TooLong` placeholder, and :func:`check_readable`
names where the first one is, as a :class:`~packtune.errors.SpecError`.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Any

from packtune.errors import SpecError


@dataclass(frozen=True)
class TooLong:
    """An integer of ``digits`` digits, more than Python reads."""

    digits: int


def read_int(text: str) -> int | TooLong:
    """``int(text)``, or a :class:`TooLong` where it has too many digits."""
    try:
        return int(text)
    except ValueError:
        return TooLong(sum(c.isdigit() for c in text))


def loads_json(text: str | bytes) -> Any:
    """``json.loads(text)``; an integer too long to read is a ``SpecError`` naming where it
    is (other errors are ``json.loads``'s)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise
    except ValueError:  # an integer over the limit (the first pass keeps the fast path)
        raw = json.loads(text, parse_int=read_int)
        check_readable(raw)
        return raw


def check_readable(raw: Any) -> None:
    """Raise ``SpecError`` at the first :class:`TooLong` in ``raw`` (JSON-like values), its
    field the dotted path to it (``space.hidden.values.1``)."""
    todo: list[tuple[tuple[str, ...], Any]] = [((), raw)]
    while todo:  # not recursive: a body nested as deep as json reads stays within the stack
        path, value = todo.pop()
        if isinstance(value, TooLong):
            raise SpecError(
                ".".join(path) or "spec",
                f"an integer of {value.digits} digits, more than the "
                f"{sys.get_int_max_str_digits()} a number may have",
            )
        if isinstance(value, dict):
            todo.extend(((*path, str(k)), v) for k, v in reversed(value.items()))
            todo.extend((path, k) for k in value if isinstance(k, TooLong))  # a YAML key
        elif isinstance(value, list):
            todo.extend(((*path, str(i)), v) for i, v in reversed(list(enumerate(value))))
