"""Where checkpoints live: ``<checkpoint_dir>/study-<id>/trial-<id>.pt`` (paths only; the
worker writes and reads them, the API streams and deletes them, the scheduler prunes them
when a study ends)."""

from __future__ import annotations

import os
from pathlib import Path


def study_folder(directory: str | os.PathLike[str], study_id: object) -> Path:
    """The folder of study ``study_id``'s checkpoints."""
    return Path(directory) / f"study-{study_id}"


def checkpoint_path(directory: str | os.PathLike[str], study_id: object, trial_id: object) -> Path:
    """Where trial ``trial_id`` of study ``study_id`` keeps its checkpoint."""
    return study_folder(directory, study_id) / f"trial-{trial_id}.pt"
