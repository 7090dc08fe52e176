"""Installing test workloads as a user would: a distribution with ``packtune.workloads``
entry points, on ``sys.path`` (and ``PYTHONPATH`` for the processes a test starts)."""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import pytest

#: this folder, which holds plugin modules (``trap_workloads``) importable by name
HERE = Path(__file__).resolve().parent


def install_plugin(root: Path, name: str, entry_points: Mapping[str, str]) -> Path:
    """Write ``<name>-0.1.dist-info`` under ``root`` with ``entry_points`` (entry name ->
    ``module:Class``) in the ``packtune.workloads`` group; returns ``root``."""
    dist = root / f"{name}-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    lines = "".join(f"{key} = {value}\n" for key, value in entry_points.items())
    (dist / "entry_points.txt").write_text(f"[packtune.workloads]\n{lines}")
    return root


@contextmanager
def registered(
    monkeypatch: pytest.MonkeyPatch, root: Path, modules: tuple[str, ...]
) -> Iterator[Path]:
    """``root`` on this process's path with the registry re-read; undone on exit."""
    import packtune.workloads as workloads

    monkeypatch.syspath_prepend(str(root))
    workloads.registry.cache_clear()
    try:
        yield root
    finally:
        workloads.registry.cache_clear()
        for module in modules:
            sys.modules.pop(module, None)


@contextmanager
def plugin_module(
    monkeypatch: pytest.MonkeyPatch,
    root: Path,
    module: str,
    source: str,
    entry_points: Mapping[str, str],
) -> Iterator[Path]:
    """``source`` written as ``<root>/<module>.py``, installed as distribution ``module``
    with ``entry_points`` (:func:`install_plugin`) and :func:`registered` while open."""
    root.mkdir()
    (root / f"{module}.py").write_text(source)
    install_plugin(root, module, entry_points)
    with registered(monkeypatch, root, (module,)):
        yield root
