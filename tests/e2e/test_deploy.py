"""The deployment files agree with the code, without a Docker engine.

The compose files, the Dockerfile, ``.env.example`` and ``.dockerignore`` are
parsed and checked against the CLI (``service.cli``, each command line parsed by the CLI itself),
the settings (``packtune.settings.Settings``) and ``pyproject.toml``.

Compose interpolation (``${VAR}``, ``${VAR:-default}``, ``${VAR:?message}``,
``$$``) is implemented here, small, to read the files as compose would with a
given ``.env``.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import tomllib
from collections.abc import Iterator, Mapping
from functools import cache
from pathlib import Path
from typing import Annotated, Any

import pytest
import typer
import yaml
from packaging.requirements import Requirement
from pydantic import TypeAdapter

from packtune.settings import ENV_PREFIX, Settings

ROOT = Path(__file__).resolve().parents[2]
MAIN, WORKER = "docker-compose.yml", "docker-compose.worker.yml"
COMPOSE_FILES = (MAIN, WORKER)
SECRET_WORDS = ("PASSWORD", "TOKEN", "SECRET")

_VAR = re.compile(r"\$(?:\$|\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?+])([^}]*))?\})")


def interpolate(text: str, env: Mapping[str, str]) -> str:
    """``text`` with compose's variable syntax replaced from ``env``."""

    def one(m: re.Match[str]) -> str:
        name, op, arg = m.group(1), m.group(2) or "", m.group(3) or ""
        if name is None:
            return "$"
        value = env.get(name)
        unset = value is None or (op.startswith(":") and value == "")
        if op.endswith("-"):
            return arg if unset else str(value)
        if op.endswith("?"):
            if unset:
                raise KeyError(f"{name} is required: {arg}")
            return str(value)
        if op.endswith("+"):
            return "" if unset else arg
        return value or ""

    return _VAR.sub(one, text)


def references(text: str) -> Iterator[tuple[str, str]]:
    """(variable, operator) for every ``${...}`` in ``text``, ``$$`` escapes skipped."""
    for m in _VAR.finditer(text):
        if m.group(1):
            yield m.group(1), m.group(2) or ""


def test_interpolation_reads_like_compose() -> None:
    env = {"A": "", "B": "", "D": "d"}
    assert interpolate("${A:-x}|${B-y}|$${C}|${D:?m}|${D:+z}|${Q}", env) == "x||${C}|d|z|"
    with pytest.raises(KeyError, match="A is required"):
        interpolate("${A:?set A}", env)
    assert list(references("$${C} ${A:-x} ${D}")) == [("A", ":-"), ("D", "")]


def read(name: str) -> str:
    return (ROOT / name).read_text()


@cache
def env_example() -> dict[str, str]:
    pairs = re.findall(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$", read(".env.example"), re.M)
    return dict(pairs)


def filled_env() -> dict[str, str]:
    """``.env.example`` with every required variable given a stand-in value."""
    required = {v for f in COMPOSE_FILES for v, op in references(read(f)) if "?" in op}
    env = dict(env_example())
    env.update({name: f"x-{name.lower()}" for name in required if not env.get(name)})
    return env


def compose(name: str) -> dict[str, Any]:
    """A compose file as compose reads it with ``filled_env()`` as its ``.env``."""
    return yaml.safe_load(interpolate(read(name), filled_env()))


def project_services(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Services that run the packtune image (built from this repository)."""
    return {name: svc for name, svc in doc["services"].items() if "build" in svc}


def env_of(svc: dict[str, Any]) -> dict[str, str]:
    env = svc.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def workers() -> Iterator[tuple[str, dict[str, Any]]]:
    for f in COMPOSE_FILES:
        for name, svc in project_services(compose(f)).items():
            if svc.get("command", [None])[0] == "worker":
                yield f"{f}:{name}", svc


# --- the Dockerfile ---------------------------------------------------------


@cache
def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, ARG defaults applied."""
    text = re.sub(r"\\\n", " ", read("Dockerfile"))
    out: list[tuple[str, str]] = []
    args: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        op, _, rest = line.partition(" ")
        rest = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), rest.strip())
        if op.upper() == "ARG" and "=" in rest:
            key, value = rest.split("=", 1)
            args[key] = value
        out.append((op.upper(), rest))
    return out


def instructions(op: str) -> list[str]:
    return [rest for o, rest in dockerfile() if o == op]


def docker_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for rest in instructions("ENV"):
        env.update(item.split("=", 1) for item in shlex.split(rest))
    return env


# --- the CLI ----------------------------------------------------------------


@cache
def cli() -> Any:
    """The packtune command group as typer builds it (its own click core)."""
    from service.cli import app

    root = typer.main.get_command(app)
    assert getattr(root, "commands", None), "the packtune CLI should be a command group"
    return root


def check_cli(args: list[str], where: str) -> None:
    """Parse ``packtune ARGS`` as the container would; fail on a usage error."""
    cmd, path, rest = cli(), ["packtune"], list(args)
    while hasattr(cmd, "commands") and rest and not rest[0].startswith("-"):
        sub = cmd.commands.get(rest[0])
        if sub is None:
            pytest.fail(f"{where}: `{' '.join(path)}` has no command {rest[0]!r}")
        path.append(rest.pop(0))
        cmd = sub
    if hasattr(cmd, "commands"):
        pytest.fail(f"{where}: `{' '.join(path)}` is a group, not a command")
    try:
        cmd.make_context(" ".join(path), rest)  # parses and converts; runs nothing
    except typer.TyperException as exc:
        pytest.fail(f"{where}: `{' '.join(['packtune', *args])}`: {exc.format_message()}")


def test_every_packtune_command_exists_in_the_cli() -> None:
    runs = [("Dockerfile CMD", json.loads(instructions("CMD")[-1]))]
    for f in COMPOSE_FILES:
        for name, svc in project_services(compose(f)).items():
            assert "entrypoint" not in svc, f"{f}:{name} must run the image's packtune entrypoint"
            command = svc["command"]
            args = shlex.split(command) if isinstance(command, str) else command
            runs.append((f"{f}:{name}", args))
    for where, args in runs:
        check_cli([str(a) for a in args], where)
    commands = {where.split(":")[-1]: args for where, args in runs}
    assert commands["migrate"] == ["db", "upgrade"]
    assert "--no-scheduler" in commands["api"]
    assert commands["scheduler"] == ["scheduler"]
    assert commands["worker"] == ["worker", "--all-gpus"]


# --- settings and variables -------------------------------------------------


def setting_values() -> Iterator[tuple[str, str, str]]:
    """(where, variable, value) for every PACKTUNE_ variable a deployment file sets."""
    for f in COMPOSE_FILES:
        for name, svc in compose(f)["services"].items():
            for key, value in env_of(svc).items():
                yield f"{f}:{name}", key, value
    for key, value in docker_env().items():
        yield "Dockerfile", key, value
    for key, value in env_example().items():
        if value:
            yield ".env.example", key, value


def field_adapter(name: str) -> TypeAdapter[Any]:
    field = Settings.model_fields[name]
    if not field.metadata:
        return TypeAdapter(field.annotation)
    return TypeAdapter(Annotated[(field.annotation, *field.metadata)])  # type: ignore[misc]


def test_every_packtune_variable_is_a_valid_setting() -> None:
    seen = set()
    for where, key, value in setting_values():
        if not key.startswith(ENV_PREFIX):
            continue
        field = key.removeprefix(ENV_PREFIX).lower()
        assert field in Settings.model_fields, f"{where}: {key} is not a packtune setting"
        field_adapter(field).validate_python(value)
        seen.add(field)
    assert {"database_url", "redis_url", "api_token", "checkpoint_dir"} <= seen


def test_compose_defaults_of_settings_are_the_settings_defaults() -> None:
    for f in COMPOSE_FILES:
        pattern = re.compile(rf"(\w+): \$\{{({ENV_PREFIX}\w+):-([^}}]*)\}}")
        for key, var, default in pattern.findall(read(f)):
            assert key == var, f"{f}: {key} is set from a different variable, {var}"
            field = key.removeprefix(ENV_PREFIX).lower()
            value = field_adapter(field).validate_python(default)
            assert value == Settings.model_fields[field].default, f"{f}: default of {key}"


def test_every_referenced_variable_is_in_env_example() -> None:
    documented = set(env_example())
    used = {var for f in COMPOSE_FILES for var, _ in references(read(f))}
    assert used - documented == set(), "missing from .env.example"
    assert documented - used == set(), ".env.example variables no compose file uses"


def test_secrets_are_required_and_never_given() -> None:
    for f in COMPOSE_FILES:
        for var, op in references(read(f)):
            if any(word in var for word in SECRET_WORDS):
                assert op == ":?", f"{f}: ${{{var}}} must be required (:?), not defaulted"
    for key, value in env_example().items():
        if any(word in key for word in SECRET_WORDS):
            assert value == "", f".env.example must not hold a value for {key}"


def test_urls_point_at_the_services() -> None:
    main = {name: env_of(s) for name, s in project_services(compose(MAIN)).items()}
    for name, env in main.items():
        assert env["PACKTUNE_DATABASE_URL"].startswith("postgresql+psycopg://"), name
        assert "@postgres:5432/" in env["PACKTUNE_DATABASE_URL"], name
        assert "@redis:6379/" in env["PACKTUNE_REDIS_URL"], name
    assert "PACKTUNE_REDIS_URL" in main["api"], "without Redis the API would run packs itself"
    assert {n for n, env in main.items() if env.get("PACKTUNE_API_TOKEN")} == {"api"}
    # Remote workers reach the same database, Redis and queue through MAIN_HOST.
    host = filled_env()["MAIN_HOST"]
    remote = env_of(compose(WORKER)["services"]["worker"])
    local = main["worker"]
    for key in ("PACKTUNE_DATABASE_URL", "PACKTUNE_REDIS_URL"):
        expected = re.sub(r"@(postgres|redis):", f"@{host}:", local[key])
        assert remote[key] == expected, key
    for key in (local.keys() & remote.keys()) - {"PACKTUNE_DATABASE_URL", "PACKTUNE_REDIS_URL"}:
        assert remote[key] == local[key], key


# --- services ---------------------------------------------------------------


def ports(svc: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(host address, published port, container port) of a service."""
    out = []
    for spec in svc.get("ports", []):
        if isinstance(spec, dict):
            out.append((spec.get("host_ip", ""), str(spec["published"]), str(spec["target"])))
            continue
        parts = str(spec).split("/")[0].split(":")
        out.append(("", *parts) if len(parts) == 2 else tuple(parts))  # type: ignore[arg-type]
    return out


def test_every_packtune_setting_in_env_reaches_the_packtune_containers() -> None:
    """docs/deploy.md has every host share the .env values of every PACKTUNE_* setting, but
    compose reads .env only to fill in ``${...}``: a setting the compose file did not name
    (PACKTUNE_COMPILE_STEP, PACKTUNE_TF32, ...) never reached a container, without a word
    (found by an audit). Each packtune service now loads .env (optional: the variables may
    come from the shell)."""
    for f in COMPOSE_FILES:
        for name, svc in project_services(compose(f)).items():
            files = svc.get("env_file")
            assert files == [{"path": ".env", "required": False}], (f, name, files)
            # but .env's API token stays with the api service, its only holder
            token = env_of(svc).get("PACKTUNE_API_TOKEN")
            assert token == (filled_env()["PACKTUNE_API_TOKEN"] if name == "api" else ""), name


def test_healthchecks() -> None:
    services = compose(MAIN)["services"]
    assert "pg_isready" in str(services["postgres"]["healthcheck"]["test"])
    assert "redis-cli ping" in str(services["redis"]["healthcheck"]["test"])
    api = services["api"]["healthcheck"]
    assert not api.get("disable") and "127.0.0.1:8000/healthz" in str(api["test"])
    (healthcheck,) = instructions("HEALTHCHECK")
    assert "/healthz" in healthcheck and "CMD" in healthcheck


def test_api_port_is_published() -> None:
    api = compose(MAIN)["services"]["api"]
    assert ("0.0.0.0", "8000", "8000") in ports(api)
    assert "8000" in instructions("EXPOSE")[0].split()


def test_database_and_redis_are_published_only_on_request() -> None:
    services = compose(MAIN)["services"]
    for name in ("postgres", "redis"):
        published = ports(services[name])
        assert all(addr == "127.0.0.1" for addr, _, _ in published), name
        raw = yaml.safe_load(read(MAIN))["services"][name].get("ports", [])
        assert all(str(spec).startswith("${") for spec in raw), f"{name}: bind address from .env"
    assert "--requirepass" in services["redis"]["command"]


def test_migrate_runs_first() -> None:
    services = compose(MAIN)["services"]
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert services["migrate"]["restart"] == "no"
    for name in ("api", "scheduler", "worker"):
        deps = services[name]["depends_on"]
        assert deps["migrate"]["condition"] == "service_completed_successfully", name
        assert deps["redis"]["condition"] == "service_healthy", name


def test_workers_reserve_nvidia_gpus() -> None:
    found = list(workers())
    assert [where for where, _ in found] == [f"{MAIN}:worker", f"{WORKER}:worker"]
    for where, svc in found:
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        assert any(
            d["driver"] == "nvidia"
            and "gpu" in d["capabilities"]
            and (d.get("count") == "all" or d.get("device_ids"))
            for d in devices
        ), where
        assert env_of(svc)["PACKTUNE_DEVICE"] == "cuda", where


def test_workers_share_the_checkpoint_volume() -> None:
    path = docker_env()["PACKTUNE_CHECKPOINT_DIR"]
    assert any(path in rest and "chown" in rest for rest in instructions("RUN"))
    for f in COMPOSE_FILES:
        doc = compose(f)
        for name, svc in project_services(doc).items():
            assert env_of(svc)["PACKTUNE_CHECKPOINT_DIR"] == path, f"{f}:{name}"
    for where, svc in workers():
        sources = [v.split(":")[0] for v in svc["volumes"] if v.split(":")[1] == path]
        assert len(sources) == 1, f"{where}: no volume at {path}"
        if where.startswith(MAIN):
            assert sources[0] in compose(MAIN)["volumes"], "a declared named volume"
        else:
            assert sources[0].startswith("/"), "a bind mount of shared storage"


def test_image_tag_is_the_project_version() -> None:
    version = tomllib.loads(read("pyproject.toml"))["project"]["version"]
    assert env_example()["APP_IMAGE"] == f"packtune:{version}"
    for f in COMPOSE_FILES:
        assert f"${{APP_IMAGE:-packtune:{version}}}" in read(f), f


# --- the image --------------------------------------------------------------


def test_image_runs_packtune_as_a_user() -> None:
    users = instructions("USER")
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert json.loads(instructions("ENTRYPOINT")[-1]) == ["packtune"]
    assert json.loads(instructions("CMD")[-1])[:1] == ["serve"]


def test_image_installs_a_cuda_torch() -> None:
    pyproject = tomllib.loads(read("pyproject.toml"))
    wanted = next(
        Requirement(r)
        for r in pyproject["project"]["dependencies"]
        if Requirement(r).name == "torch"
    )
    base = instructions("FROM")[0]
    torch_runs = [r for r in instructions("RUN") if "pip install" in r and "torch==" in r]
    assert torch_runs, "torch is installed with a pinned version"
    (run,) = torch_runs
    version = re.search(r"torch==([\w.+]+)", run)
    assert version and wanted.specifier.contains(version.group(1)), "pin satisfies pyproject"
    index = re.search(r"--(?:extra-)?index-url[ =](\S+)", run)
    cuda_wheels = index is not None and re.search(r"/whl/cu\d+$", index.group(1)) is not None
    assert cuda_wheels or base.startswith("nvidia/cuda"), "torch must be a CUDA build"


def test_image_copies_what_pip_install_needs() -> None:
    pyproject = tomllib.loads(read("pyproject.toml"))
    needed = {"pyproject.toml", pyproject["project"].get("readme", "pyproject.toml")}
    packages = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    needed |= {p.rstrip("*") for p in packages}
    copied = {
        src.rstrip("/")
        for rest in instructions("COPY")
        for src in rest.split()[:-1]
        if not src.startswith("--")
    }
    assert needed <= copied
    assert all((ROOT / path).exists() for path in needed), "pip install . needs them all"
    assert any(re.search(r"pip install \.(\s|$)", r) for r in instructions("RUN"))
    ignored = [p for p in read(".dockerignore").splitlines() if p and not p.startswith("#")]
    for path in needed:
        hits = [p for p in ignored if fnmatch.fnmatch(path, p.rstrip("/"))]
        assert not hits, f".dockerignore drops {path} ({hits})"
    for must_go in (".venv", ".git", ".env"):
        assert must_go in ignored, f".dockerignore must exclude {must_go}"
