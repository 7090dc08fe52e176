"""Per-trial checkpoints, written atomically.

A checkpoint is one member's exported state (:meth:`FusedArray.member_state`:
params, buffers, optimizer state, RNG state, steps done, config) saved with
``torch.save`` at ``<checkpoint_dir>/study-<id>/trial-<id>.pt``.

Writing goes to a temporary file in the same directory, is flushed and
fsynced, then ``os.replace``-d over the old file: a reader sees either the
old checkpoint or the new one, never half of one, and a job killed mid-write
leaves at most a stray ``.tmp`` file that no reader opens.

Loading uses ``torch.load(weights_only=True)``: the checkpoint directory may
be shared storage other hosts write to, and a full unpickler would run
whatever code a tampered file names. A member state holds only tensors,
dicts, lists, strings and numbers, all of which the restricted unpickler
accepts; anything else makes loading fail loudly instead of executing.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from packtune.checkpoints import checkpoint_path
from packtune.settings import get_settings

__all__ = ["Staged", "checkpoint_path", "load_checkpoint", "save_checkpoint", "stage_checkpoint"]


def _fsync_directory(path: Path) -> None:
    """Make a rename in ``path`` durable (best effort: not every platform allows it)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def save_checkpoint(
    directory: str | os.PathLike[str], study_id: object, trial_id: object, state: Mapping[str, Any]
) -> Path:
    """Write ``state`` atomically as the trial's checkpoint; returns its path."""
    staged = stage_checkpoint(directory, study_id, trial_id, state)
    staged.commit()
    return staged.path


@dataclass(frozen=True)
class Staged:
    """A checkpoint written, flushed and fsynced beside its place, not yet in it: a job
    puts it in place (:meth:`commit`) only once the database has taken its unit as done,
    so that a job that lost its pack (its worker was taken for dead and the pack trained
    again elsewhere) never overwrites a newer checkpoint with its own."""

    path: Path
    tmp: Path

    def commit(self) -> None:
        """Put it in place (again: nothing, so a retried transaction may call it twice)."""
        if self.tmp.exists():
            os.replace(self.tmp, self.path)
            _fsync_directory(self.path.parent)

    def discard(self) -> None:
        self.tmp.unlink(missing_ok=True)


def stage_checkpoint(
    directory: str | os.PathLike[str], study_id: object, trial_id: object, state: Mapping[str, Any]
) -> Staged:
    """Write ``state`` as the trial's next checkpoint, not yet in place (:class:`Staged`)."""
    full = get_settings().disk_full_while
    if full is not None and full.exists():  # fault injection (PACKTUNE_DISK_FULL_WHILE)
        raise OSError(errno.ENOSPC, "No space left on device (injected)", str(directory))
    # serialized in memory first: torch.save writing to a full disk raised its own
    # RuntimeError ("unexpected pos"), not the OSError that marks a fault of the machine, so
    # a full disk used up the pack's attempts and failed its trials
    buffer = io.BytesIO()
    torch.save(dict(state), buffer)
    path = checkpoint_path(directory, study_id, trial_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(buffer.getbuffer())
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return Staged(path, tmp)


def load_checkpoint(path: str | os.PathLike[str], mmap: bool = False) -> dict[str, Any] | None:
    """The state saved at ``path``, on the CPU; ``None`` if there is no checkpoint.
    ``mmap``: its tensors mapped from the file, read only when used (cheap when only
    ``steps_done`` or a part of the state is wanted).

    A file that exists but cannot be read (corrupt, or holding objects the
    restricted unpickler refuses) raises: silently restarting a trial from
    scratch would corrupt the study's results.
    """
    try:
        state = torch.load(Path(path), map_location="cpu", weights_only=True, mmap=mmap)
    except FileNotFoundError:
        return None
    if not isinstance(state, dict):
        raise ValueError(f"{path} does not hold a checkpoint (got {type(state).__name__})")
    return state
