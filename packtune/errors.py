"""The packtune exception tree, mapped to HTTP status codes in one handler.

PacktuneError
├── SpecError          (422) a study spec is invalid; ``field`` names the part
├── NotFound           (404) no such study / trial / pack
├── Conflict           (409) the request does not fit the object's state
└── StoreUnavailable   (503) the database cannot be reached
"""

from __future__ import annotations


class PacktuneError(Exception):
    """Base of every error packtune raises on purpose."""

    status_code = 500


class SpecError(PacktuneError, ValueError):
    """A study spec is invalid. ``field`` is a dotted path such as ``space.lr.low``."""

    status_code = 422

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class NotFound(PacktuneError, LookupError):
    status_code = 404


class Conflict(PacktuneError):
    status_code = 409


class StoreUnavailable(PacktuneError):
    status_code = 503


class QueueUnavailable(PacktuneError):
    """The job queue (Redis) cannot be reached; the scheduler waits for it, saying so once."""

    status_code = 503


class DeviceUnavailable(PacktuneError):
    """The device the settings ask for (``PACKTUNE_DEVICE=cuda``) is not there: a worker
    cannot train on it. ``packtune run`` and ``packtune worker`` stop with this text."""


class StudyCannotRun(PacktuneError):
    """A stored study that can never run as it is: its workload is no longer registered, or
    its space no longer fits the workload. The scheduler fails the study with this text."""


#: Where a trial's error text turns from its cause (shared by every trial with the same
#: fault) to details of the one trial (its parameters): ``ValueError: ... [in ...]``.
DETAILS = "in "


def error_cause(text: str) -> str:
    """The cause of a trial's error text (its first line, up to the trial's details), the
    key by which errors are grouped."""
    first = text.strip().splitlines()[0] if text.strip() else "no error recorded"
    return first.split(f" [{DETAILS}", 1)[0][:300]
