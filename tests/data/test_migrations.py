"""The migrations build exactly the schema ``service.models`` describes, on both backends."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy.engine import URL, make_url

from packtune.errors import StoreUnavailable
from service.db import alembic_config, make_engine, upgrade
from service.models import Base

PG_SCHEMA = "packtune_test_migrations"
REPO = Path(__file__).resolve().parents[2]
HEAD = "0014"
TABLES = {table.name for table in Base.metadata.sorted_tables}


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def empty_url(request: pytest.FixtureRequest) -> Iterator[str | URL]:
    """An empty database: a new SQLite file, or a new private PostgreSQL schema."""
    if request.param == "sqlite":
        yield request.getfixturevalue("sqlite_url")
        return
    base = request.getfixturevalue("postgres_url")
    admin = make_engine(base)
    with admin.begin() as conn:
        conn.exec_driver_sql(f"DROP SCHEMA IF EXISTS {PG_SCHEMA} CASCADE")
        conn.exec_driver_sql(f"CREATE SCHEMA {PG_SCHEMA}")
    yield make_url(base).update_query_dict({"options": f"-csearch_path={PG_SCHEMA}"})
    with admin.begin() as conn:
        conn.exec_driver_sql(f"DROP SCHEMA IF EXISTS {PG_SCHEMA} CASCADE")
    admin.dispose()


def inspect_db(url: str | URL) -> tuple[set[str], list[Any], str | None]:
    """(table names, differences from the models, Alembic revision) of the database at ``url``."""
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(conn)
            return (
                set(sa.inspect(conn).get_table_names()),
                compare_metadata(context, Base.metadata),
                context.get_current_revision(),
            )
    finally:
        engine.dispose()


def test_upgrade_builds_the_models_schema(empty_url: str | URL) -> None:
    upgrade(empty_url)
    tables, diff, revision = inspect_db(empty_url)
    assert tables == TABLES | {"alembic_version"}
    assert diff == []
    assert revision == HEAD


def test_upgrade_twice_is_a_no_op(empty_url: str | URL) -> None:
    upgrade(empty_url)
    engine = make_engine(empty_url)
    with engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO leases VALUES ('x', 'me', CURRENT_TIMESTAMP)"))
    upgrade(empty_url)
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT holder FROM leases")).scalars().all() == ["me"]
    engine.dispose()
    tables, diff, revision = inspect_db(empty_url)
    assert (tables, diff, revision) == (TABLES | {"alembic_version"}, [], HEAD)


def test_downgrade_removes_everything(empty_url: str | URL) -> None:
    upgrade(empty_url)
    command.downgrade(alembic_config(empty_url), "base")
    assert inspect_db(empty_url)[0] == {"alembic_version"}
    upgrade(empty_url)
    assert inspect_db(empty_url)[1] == []


def test_comparison_notices_a_difference(sqlite_url: str) -> None:
    """The no-difference checks above can fail: a model change shows up."""
    upgrade(sqlite_url)
    changed = sa.MetaData()
    for table in Base.metadata.sorted_tables:
        table.to_metadata(changed)
    sa.Index("ix_probe", changed.tables["workers"].c.host)
    changed.tables["leases"].append_column(sa.Column("probe", sa.Integer()))
    engine = make_engine(sqlite_url)
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), changed)
    engine.dispose()
    assert sorted(d[0] for d in diff) == ["add_column", "add_index"]


def test_upgrade_defaults_to_settings_url_from_any_directory(
    clean_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    db = tmp_path / "from-settings.db"
    clean_env.setenv("PACKTUNE_DATABASE_URL", f"sqlite:///{db}")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    clean_env.chdir(elsewhere)
    upgrade()
    assert inspect_db(f"sqlite:///{db}")[0] == TABLES | {"alembic_version"}
    assert list(elsewhere.iterdir()) == []


def test_alembic_command_line(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    db = tmp_path / "cli.db"
    clean_env.setenv("PACKTUNE_DATABASE_URL", f"sqlite:///{db}")
    subprocess.run(
        [sys.executable, "-m", "alembic", "-c", "migrations/alembic.ini", "upgrade", "head"],
        cwd=REPO,
        check=True,
        capture_output=True,
    )
    assert inspect_db(f"sqlite:///{db}")[1:] == ([], HEAD)


def test_upgrade_of_unreachable_database_is_store_unavailable() -> None:
    with pytest.raises(StoreUnavailable):
        upgrade("postgresql://postgres@127.0.0.1:1/test?connect_timeout=2")


def test_0002_fills_each_trials_latest_objective(empty_url: str | URL) -> None:
    """Trials measured before 0002 get the resource and objective of their latest measurement."""
    command.upgrade(alembic_config(empty_url), "0001")
    engine = make_engine(empty_url)
    spec = '{"objective": {"metric": "acc", "mode": "max"}, "hyperband": {"max_resource": 9}}'
    with engine.begin() as conn:
        conn.exec_driver_sql(
            "INSERT INTO studies (id, name, workload, spec, seed, status, created_at)"
            f" VALUES (1, 's', 'digits-mlp', '{spec}', 0, 'running', '2026-11-22 00:00:00')"
        )
        for trial_id in (1, 2, 3):
            conn.exec_driver_sql(
                "INSERT INTO trials (id, study_id, sample_index, bracket, rung, config, fusion_key,"
                " status, resource_done, created_at, updated_at) VALUES"
                f" ({trial_id}, 1, {trial_id}, 0, 0, '{{}}', 'k', 'paused', 3,"
                " '2026-11-22 00:00:00', '2026-11-22 00:00:00')"
            )
        points = [(1, 1.0, '{"acc": 0.5}'), (1, 3.0, '{"acc": 0.75}'), (2, 1.0, '{"acc": null}')]
        for trial_id, resource, metrics in points:
            conn.exec_driver_sql(
                "INSERT INTO measurements (trial_id, resource, metrics, created_at)"
                f" VALUES ({trial_id}, {resource}, '{metrics}', '2026-11-22 00:00:00')"
            )
    engine.dispose()
    upgrade(empty_url)
    engine = make_engine(empty_url)
    with engine.connect() as conn:
        rows = conn.exec_driver_sql(
            "SELECT id, measured_resource, objective FROM trials ORDER BY id"
        ).all()
    engine.dispose()
    assert [tuple(row) for row in rows] == [(1, 3.0, 0.75), (2, 1.0, None), (3, None, None)]


def insert_rows(
    conn: sa.Connection, stamp: str, trial: tuple[str, float], pack: tuple[str, int], to: float
) -> None:
    """Study 1, its trial 1 (status, epochs done) and pack 1 (status, attempts) training it
    from 0 to ``to``, written at ``stamp`` (in the columns every revision from 0008 has)."""
    status, done = trial
    conn.exec_driver_sql(
        "INSERT INTO studies (id, name, workload, spec, seed, status, created_at)"
        f" VALUES (1, 's', 'digits-mlp', '{{}}', 0, 'running', {stamp})"
    )
    conn.exec_driver_sql(
        "INSERT INTO trials (id, study_id, sample_index, bracket, rung, config, fusion_key,"
        f" status, resource_done, created_at, updated_at) VALUES (1, 1, 0, 0, 0, '{{}}',"
        f" 'k', '{status}', {done}, {stamp}, {stamp})"
    )
    conn.exec_driver_sql(
        "INSERT INTO packs (id, study_id, status, attempts, created_at)"
        f" VALUES (1, 1, '{pack[0]}', {pack[1]}, {stamp})"
    )
    conn.exec_driver_sql(
        "INSERT INTO pack_members (pack_id, trial_id, fusion_key, from_resource, to_resource)"
        f" VALUES (1, 1, 'k', 0, {to})"
    )


def test_0009_keeps_pack_members_as_whole_trials(empty_url: str | URL) -> None:
    """Members planned before 0009 become whole-trial members (segment -1); after it, two
    segments of one trial may share a pack; downgrading keeps one row per trial."""
    command.upgrade(alembic_config(empty_url), "0008")
    engine = make_engine(empty_url)
    stamp = "'2026-11-25 00:00:00'"
    with engine.begin() as conn:
        insert_rows(conn, stamp, trial=("queued", 0), pack=("pending", 0), to=1)
    engine.dispose()
    upgrade(empty_url)
    engine = make_engine(empty_url)
    with engine.begin() as conn:
        rows = conn.exec_driver_sql("SELECT trial_id, segment FROM pack_members").all()
        assert [tuple(r) for r in rows] == [(1, -1)]
        for segment in (0, 1):
            conn.exec_driver_sql(
                "INSERT INTO pack_members (pack_id, trial_id, segment, fusion_key,"
                f" from_resource, to_resource) VALUES (1, 1, {segment}, 'k', 1, 3)"
            )
        with pytest.raises(sa.exc.IntegrityError):  # (pack, trial, segment) is the key
            with conn.begin_nested():
                conn.exec_driver_sql(
                    "INSERT INTO pack_members (pack_id, trial_id, segment, fusion_key,"
                    " from_resource, to_resource) VALUES (1, 1, 1, 'k', 1, 3)"
                )
    engine.dispose()
    command.downgrade(alembic_config(empty_url), "0008")
    engine = make_engine(empty_url)
    with engine.connect() as conn:
        rows = conn.exec_driver_sql("SELECT trial_id, to_resource FROM pack_members")
        assert [tuple(r) for r in rows] == [(1, 1.0)]  # segment -1, the lowest
    engine.dispose()


def test_downgrading_keeps_the_rows_of_tables_copied_on_sqlite(empty_url: str | URL) -> None:
    """Downgrades that drop a column of ``studies``, ``trials`` or ``packs`` copy the table to
    a new one on SQLite (batch mode) and drop the old one; with foreign keys on, that drop
    deleted every row referring to it (``ON DELETE CASCADE``): a study's trials, packs,
    measurements and pack members. Down to 0001 and up again, every row is still there."""
    upgrade(empty_url)
    engine = make_engine(empty_url)
    stamp = "'2026-11-28 00:00:00'"
    with engine.begin() as conn:
        insert_rows(conn, stamp, trial=("running", 1), pack=("running", 1), to=3)
        conn.exec_driver_sql(
            "INSERT INTO measurements (trial_id, resource, metrics, created_at)"
            f" VALUES (1, 1.0, '{{\"val_loss\": 0.5}}', {stamp})"
        )
    engine.dispose()
    tables = ("studies", "trials", "measurements", "packs", "pack_members")

    def counts() -> dict[str, int]:
        engine = make_engine(empty_url)
        try:
            with engine.connect() as conn:
                return {t: conn.exec_driver_sql(f"SELECT count(*) FROM {t}").scalar_one()
                        for t in tables}  # fmt: skip
        finally:
            engine.dispose()

    command.downgrade(alembic_config(empty_url), "0001")
    assert counts() == dict.fromkeys(tables, 1)
    upgrade(empty_url)
    assert counts() == dict.fromkeys(tables, 1)
    assert inspect_db(empty_url)[1] == []


def test_an_upgrade_beside_another_process_migrating_the_same_file_waits_for_it(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two processes starting at once on a new SQLite file both migrated it, a step at a
    time, and the slower failed on the other's work ("duplicate column name"; alembic's
    "expected to match one row"): a traceback from `packtune run`. Here the other process
    (a real one) migrates part of the way as this one's first attempt collides."""
    real = command.upgrade
    calls = []

    def colliding(config: Any, revision: str) -> None:
        calls.append(revision)
        if len(calls) == 1:  # another process is half-way when this one trips on its work
            subprocess.run(
                [sys.executable, "-c", "import sys; from alembic import command; from "
                 "service.db import alembic_config; command.upgrade(alembic_config(sys.argv[1]),"
                 " '0008')", sqlite_url],
                check=True, cwd=Path(__file__).resolve().parents[2],
            )  # fmt: skip
            raise sa.exc.OperationalError("ALTER TABLE", {}, Exception("duplicate column name"))
        real(config, revision)

    monkeypatch.setattr(command, "upgrade", colliding)
    upgrade(sqlite_url)
    assert inspect_db(sqlite_url)[1:] == ([], HEAD)
    assert len(calls) == 2
    # a failure while nobody moves the schema on is not waited out
    calls.clear()
    monkeypatch.setattr(command, "upgrade", lambda config, revision: (_ for _ in ()).throw(
        sa.exc.OperationalError("ALTER TABLE", {}, Exception("disk I/O error"))))  # fmt: skip
    with pytest.raises(StoreUnavailable, match="disk I/O error"):
        upgrade(sqlite_url)
