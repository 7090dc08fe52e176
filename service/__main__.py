"""The ``packtune`` command (``python -m service`` too); the commands are in :mod:`service.cli`.

The command's entry point imports nothing until it runs: the embedded runners are
spawned processes, and a spawned child first imports its parent's main module, the
``packtune`` script, again, before it trains anything. Pointed at :mod:`service.cli`,
that script made every runner import the CLI (typer, rich: ~0.15 s on a 2-core CPU) on
the first pack's critical path; pointed here, the child imports this module only (and
``python -m service`` children skip it: a package's ``__main__`` is never imported again).
"""

from __future__ import annotations


def main() -> None:
    from service.cli import main as run_cli

    run_cli()


if __name__ == "__main__":
    main()
