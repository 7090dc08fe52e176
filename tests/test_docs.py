"""The code cites only documents the repository has."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CITED = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*[\w.-]+\.md)\b")


def test_every_document_named_in_the_code_exists() -> None:
    missing = []
    for folder in ("packtune", "service", "worker", "tests", "bench", "migrations"):
        for path in (ROOT / folder).rglob("*.py"):
            for name in CITED.findall(path.read_text()):
                candidates = [
                    ROOT / name,
                    ROOT / "docs" / name,
                    ROOT / "bench" / name,
                    path.parent / name,
                ]
                if not any(c.is_file() for c in candidates):
                    missing.append(f"{path.relative_to(ROOT)}: {name}")
    assert not missing, missing


def test_the_design_names_modules_and_functions_that_exist() -> None:
    """Every dotted name the design cites (``service.lifecycle.sample_due``) resolves."""
    text = (ROOT / "docs" / "design.md").read_text()
    names = set(re.findall(r"`((?:packtune|service|worker)(?:\.\w+)+)", text))
    assert len(names) > 20
    missing = []
    for dotted in sorted(names):
        parts = dotted.split(".")
        for n in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:n]))
            except ModuleNotFoundError:
                continue
            try:
                for attr in parts[n:]:
                    obj = getattr(obj, attr)
            except AttributeError:
                missing.append(dotted)
            break
        else:
            missing.append(dotted)
    assert not missing, missing


def test_every_file_the_docs_name_exists() -> None:
    """``packtune/hyperband.py`` in the README or a design document is a file of the repo."""
    missing = []
    for doc in [ROOT / "README.md", ROOT / "bench" / "README.md", *(ROOT / "docs").glob("*.md")]:
        for path in re.findall(r"`((?:packtune|service|worker|tests|bench|migrations)/[\w/.-]+)`",
                               doc.read_text()):  # fmt: skip
            generated = path.rstrip("/").rsplit("/", 1)[-1].startswith(".")  # bench/.wheels
            if not generated and not (ROOT / path.rstrip("/")).exists():
                missing.append(f"{doc.name}: {path}")
    assert not missing, missing


def test_the_public_names_examples_run() -> None:
    """The examples in the public names' docstrings (Workload, Split, epoch_generator,
    Client) are doctests: they run and say what they claim."""
    import doctest

    import packtune.client
    import packtune.workloads.base

    for module in (packtune.workloads.base, packtune.client):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0, module.__name__
    assert doctest.testmod(packtune.workloads.base).attempted >= 5


def test_the_public_surface_is_importable_from_packtune() -> None:
    import packtune

    for name in packtune.__all__:
        assert getattr(packtune, name) is not None, name
