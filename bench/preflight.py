"""Before a benchmark run on a borrowed box: is everything packtune needs installed?

Reads the runtime requirements of ``pyproject.toml`` (``[project] dependencies``, and
the extras named with ``--extra``) and follows each installed distribution's own
requirements, so that a package that imports but lacks one of its needs (Optuna without
colorlog) is caught too. Prints one line per missing or too old distribution and exits 1;
prints ``ok: ...`` and exits 0 when nothing is missing. It reads package
metadata only (no imports): seconds, where a run that fails at its first study costs
minutes of a GPU's time.

    python -m bench.preflight                  # the service's and workers' needs
    python -m bench.preflight --extra bench    # and the benchmarks' extras
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from collections.abc import Callable, Iterable
from importlib import metadata
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent

#: name -> (installed version, its own requirement strings); None where not installed
Lookup = Callable[[str], tuple[str, list[str]] | None]


def installed(name: str) -> tuple[str, list[str]] | None:
    """The installed distribution ``name``'s version and requirements (None if absent)."""
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return None
    return dist.version, list(dist.requires or [])


def problems(requirements: Iterable[str], lookup: Lookup = installed) -> list[str]:
    """What is missing or too old among ``requirements`` and, recursively, the requirements
    of the installed distributions they name (environment markers evaluated here, with the
    extras each was asked for), one message per distribution, in the order met."""
    out: list[str] = []
    seen: set[tuple[str, frozenset[str]]] = set()
    queue: list[tuple[str, str | None, frozenset[str]]] = [
        (text, None, frozenset()) for text in requirements
    ]
    while queue:
        text, needed_by, extras = queue.pop(0)
        try:
            req = Requirement(text)
        except InvalidRequirement as exc:
            out.append(f"{text!r}: not a requirement ({exc})")
            continue
        env = [{"extra": e} for e in extras] or [{"extra": ""}]
        if req.marker is not None and not any(req.marker.evaluate(e) for e in env):
            continue
        name = canonicalize_name(req.name)
        key = (name, frozenset(req.extras))
        if key in seen:
            continue
        seen.add(key)
        by = f" (needed by {needed_by})" if needed_by else ""
        found = lookup(name)
        if found is None:
            out.append(f"{req.name}{req.specifier}: not installed{by}")
            continue
        version, needs = found
        if req.specifier and not req.specifier.contains(version, prereleases=True):
            out.append(f"{req.name}{req.specifier}: {version} is installed{by}")
            continue
        queue += [(need, req.name, frozenset(req.extras)) for need in needs]
    return out


def project_requirements(extras: Iterable[str] = (), pyproject: Path | None = None) -> list[str]:
    """The runtime requirements of the project (and of ``extras``) from ``pyproject.toml``."""
    data = tomllib.loads((pyproject or ROOT / "pyproject.toml").read_text())
    project = data["project"]
    optional = project.get("optional-dependencies", {})
    unknown = sorted(set(extras) - set(optional))
    if unknown:
        raise ValueError(f"no such extra in pyproject.toml: {', '.join(unknown)}")
    return [*project["dependencies"], *(r for e in extras for r in optional[e])]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--extra", action="append", default=[], help="an extra of pyproject.toml")
    args = parser.parse_args(argv)
    try:
        requirements = project_requirements(args.extra)
    except ValueError as exc:
        print(f"preflight: {exc}", file=sys.stderr)
        return 2
    found = problems(requirements)
    for line in found:
        print(f"missing: {line}")
    if found:
        print(f"preflight: {len(found)} missing; nothing was run", file=sys.stderr)
        return 1
    print(f"ok: {len(requirements)} requirements and theirs installed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
