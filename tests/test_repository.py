"""The repository tracks sources, not what running them leaves behind."""

from __future__ import annotations

import fnmatch
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# What a run writes into the working directory: the embedded default's SQLite
# database and its side files, checkpoints, test artifacts, caches.
RUN_LEFTOVERS = (
    "*.db",
    "*.db-shm",
    "*.db-wal",
    "*.db-journal",
    "*.pyc",
    "packtune-checkpoints/*",
    "test-artifacts/*",
)


def test_no_file_a_run_leaves_behind_is_tracked() -> None:
    if not (ROOT / ".git").exists():  # e.g. an unpacked source archive
        pytest.skip("not a git checkout")
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert tracked, "git ls-files listed nothing: not a checkout?"
    leftovers = [name for name in tracked if any(fnmatch.fnmatch(name, p) for p in RUN_LEFTOVERS)]
    assert not leftovers, leftovers
