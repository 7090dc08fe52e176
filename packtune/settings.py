"""One settings object for every packtune process.

Every field is read from the environment with the ``PACKTUNE_`` prefix
(``PACKTUNE_DATABASE_URL``, ``PACKTUNE_REDIS_URL``, ...). A bad value stops
start-up: :func:`get_settings` raises :class:`SettingsError` whose message is
one line naming the variable.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

ENV_PREFIX = "PACKTUNE_"
#: the worker name a job claims packs under (set by ``packtune worker`` and the embedded
#: runners for their jobs; not a setting)
WORKER_NAME_ENV = f"{ENV_PREFIX}WORKER_NAME"


def default_torch_threads(share: int = 1) -> int:
    """Torch threads of a worker when ``torch_threads`` is unset: all cores but one (small
    models gain nothing from more, and the scheduler needs a core), divided between
    ``share`` processes training side by side (at least one each)."""
    return max(1, ((os.cpu_count() or 2) - 1) // share)


class SettingsError(ValueError):
    """A setting from the environment has a bad value."""


#: ``dialect[+driver]://...``, as SQLAlchemy parses a database URL
DATABASE_URL = re.compile(r"^[A-Za-z][A-Za-z0-9_]*(\+[A-Za-z0-9_]+)?://")
#: the schemes redis-py's ``Redis.from_url`` takes
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
#: the longest interval or timeout a setting may give, in seconds (about 30 years: "never"
#: in practice): much larger ones overflow the date arithmetic of leases and heartbeats
#: (``inf``: every tick failed)
LONGEST_SECONDS = 1e9


def token_problem(token: str) -> str | None:
    """Why ``token`` cannot be a bearer token, or None: it travels in an HTTP header."""
    if not all(" " <= c <= "~" for c in token):
        return "must be printable ASCII (a bearer token travels in an HTTP header)"
    if token != token.strip(" "):  # spaces inside pass through a header whole
        return (
            "must not start or end with a space "
            "(a bearer token travels in an HTTP header, which drops them)"
        )
    return None


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore")

    database_url: str = Field(
        default="sqlite:///packtune.db",
        description="SQLAlchemy URL; default a SQLite file in the working directory.",
    )
    redis_url: str | None = Field(
        default=None,
        description="Redis URL for RQ; unset means packs run in-process (embedded mode).",
    )
    api_token: SecretStr | None = Field(
        default=None, description="Bearer token every POST must carry; unset leaves the API open."
    )
    checkpoint_dir: Path = Field(
        default=Path("packtune-checkpoints"),
        description="Trial checkpoints; shared storage when workers run on several hosts.",
    )
    keep_checkpoints: int = Field(
        default=5,
        ge=0,
        description="When a study ends, the checkpoints of its stopped trials are deleted but "
        "for the best this many by the objective (completed trials keep theirs).",
    )
    data_dir: Path | None = Field(
        default=None, description="Folder with datasets (CIFAR-10 for resnet-cifar)."
    )
    queue_name: str = Field(default="packtune", min_length=1, description="RQ queue name.")
    job_timeout: int = Field(default=3600, gt=0, description="RQ job timeout per pack, seconds.")
    check_seconds: float = Field(
        default=120.0, gt=0, le=LONGEST_SECONDS,
        description="The longest a workload check asked of the service runs: packs wait behind it.",
    )  # fmt: skip
    max_attempts: int = Field(
        default=3,
        ge=1,
        description="Attempts per pack before its trials fail; attempts ended by a fault that "
        "is not the trials' (storage, database, job queue, a worker gone) do not count.",
    )
    retry_backoff: float = Field(
        default=2.0,
        ge=0,
        le=LONGEST_SECONDS,
        allow_inf_nan=False,
        description="Seconds before a failed pack's first retry, doubled each attempt (up to "
        "60 s) with jitter; 0 retries at once.",
    )
    scheduler_interval: float = Field(
        default=0.5,
        gt=0,
        le=LONGEST_SECONDS,
        allow_inf_nan=False,
        description="Seconds between scheduler ticks.",
    )
    heartbeat_interval: float = Field(
        default=5.0,
        gt=0,
        le=LONGEST_SECONDS,
        allow_inf_nan=False,
        description="Seconds between worker heartbeats.",
    )
    heartbeat_timeout: float = Field(
        default=30.0,
        gt=0,
        le=LONGEST_SECONDS,
        allow_inf_nan=False,
        description=(
            "A worker silent this long is dead; its packs re-queue. On PostgreSQL a "
            "worker's session idle inside a transaction this long is ended by the server."
        ),
    )
    cpu_memory_budget: int = Field(
        default=4 * 2**30, gt=0, description="Bytes a CPU device may give one pack."
    )
    spill: bool = Field(
        default=True,
        description="Train a trial whose estimated memory exceeds every device's by spilling: "
        "its model (an nn.Sequential) cut into shards of layers kept in host memory and moved "
        "through the device in turn; false: such a trial fails as fitting no device.",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto", description="Device a worker trains on."
    )
    torch_threads: int | None = Field(
        default=None,
        ge=1,
        description="CPU threads torch may use in a worker; default: all cores but one.",
    )
    embedded_runners: int = Field(
        default=1,
        ge=1,
        le=64,
        description=(
            "Processes the embedded runner (packtune run, serve without Redis) trains packs in, "
            "each a pack at a time, as that many RQ workers would: on a CPU with idle cores "
            "between one runner's packs (its scheduling, data and writes are one thread's), "
            "2 keeps them busy. Each takes a share of the cores (torch threads: all cores but "
            "one, divided). On a GPU: 1 (packs are sized for the whole device)."
        ),
    )
    array_threads: int | None = Field(
        default=None,
        ge=1,
        description=(
            "Arrays of one pack trained at once, each in a thread (a pack holds one array per "
            "fusion key and resource span); default: up to 4 on a GPU, on a CPU cores // torch "
            "threads; 1 = one after another."
        ),
    )
    compile_step: Literal["off", "on"] = Field(
        default="off",
        description=(
            "'on': each fused stack's training step (forward, loss, backward) is compiled with "
            "torch.compile, per model structure in a worker process (array sizes and batch "
            "shapes after the second share a compilation with symbolic sizes where the "
            "workload allows), and reused by later packs; a step that fails to compile is "
            "tried with fixed shapes, then trains eagerly, with a warning. Off by default: on "
            "a 2-core CPU a compilation costs seconds for a step 0.7-1.3x as fast as eager "
            "(bench a's compiled variant); on a GPU not yet measured."
        ),
    )
    compile_mode: (
        Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] | None
    ) = Field(
        default=None,
        description=(
            "torch.compile mode of compiled steps; default 'reduce-overhead' on a GPU (CUDA "
            "graphs), 'default' on a CPU."
        ),
    )
    tf32: bool | None = Field(
        default=None,
        description=(
            "TensorFloat-32 on a GPU: true = matmuls and cuDNN convolutions in TF32 (faster on "
            "Ampere and later; ~1e-3 relative rounding), false = neither, unset = torch's "
            "defaults (convolutions in TF32, matmuls not). A worker's setting: every study it "
            "trains rounds so."
        ),
    )
    share_packs: bool = Field(
        default=True,
        description=(
            "Plan the ready trials of every running study together: studies share packs, and "
            "trials of different studies fuse into one array where that is exact (same "
            "workload, structural values, data seed and training); false: one study per pack."
        ),
    )
    dispatch_order: Literal["fair", "id"] = Field(
        default="fair",
        description=(
            "Which ready work goes first: 'fair' shares device time between running studies "
            "in proportion to their priority, then takes the longest remaining work first; "
            "'id' takes studies and packs in the order they were created."
        ),
    )
    preempt: bool = Field(
        default=True,
        description=(
            "With dispatch_order 'fair': a running pack gives its device up at its next "
            "training step when a pack of a study in a better fair-share band waits and no "
            "device is free; its trials keep what they trained and are planned again. "
            "false: a running pack always trains to its end."
        ),
    )
    fair_share_quantum: float | None = Field(
        default=None,
        gt=0,
        le=LONGEST_SECONDS,
        allow_inf_nan=False,
        description=(
            "Device-seconds (per unit of priority) within which studies count as equally "
            "served: they share packs, and longest-remaining-first decides between their "
            "trials; a study further ahead waits for the others' packs. Default: the median "
            "time of the last 50 packs (at least 1 s)."
        ),
    )
    runner_nice: int = Field(
        default=10,
        ge=0,
        le=19,
        description=(
            "CPU priority the embedded runner trains at (a nice increment): the API and the "
            "scheduler beside it stay responsive on a busy CPU; 0 = the same priority."
        ),
    )
    oom_above: int | None = Field(
        default=None,
        ge=0,
        description="Fault injection: packs with more trials than this raise CUDA out-of-memory "
        "(0: every pack, as a model larger than the device).",
    )
    disk_full_while: Path | None = Field(
        default=None,
        description="Fault injection: while this file exists, saving a checkpoint fails as on "
        "a full disk (ENOSPC).",
    )
    body_timeout: float = Field(
        default=10.0,
        gt=0,
        le=LONGEST_SECONDS,
        allow_inf_nan=False,
        description="Seconds the API waits for each part of a request's body before it "
        "answers 408 (slow clients); headers are the reverse proxy's to bound.",
    )
    read_cache_seconds: float = Field(
        default=1.0,
        ge=0,
        le=LONGEST_SECONDS,
        allow_inf_nan=False,
        description="Seconds the API may serve a study GET from its micro-cache; 0 turns it off.",
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        default="INFO", description="Log level."
    )

    @field_validator("api_token", "disk_full_while", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: object) -> object:
        """``PACKTUNE_API_TOKEN=`` (as compose writes a variable it leaves out) is no token,
        not a token that is empty (writes needed ``Bearer`` and nothing, which the client
        never sends); ``PACKTUNE_DISK_FULL_WHILE=`` is no file, not ``.`` (which always
        exists: every checkpoint failed as on a full disk)."""
        return None if isinstance(value, str) and not value.strip() else value

    @field_validator("api_token")
    @classmethod
    def _a_header_value(cls, token: SecretStr | None) -> SecretStr | None:
        """A token outside printable ASCII was accepted, and no request could carry it (a
        header's bytes are Latin-1 on the server, and httpx refuses to encode it)."""
        problem = None if token is None else token_problem(token.get_secret_value())
        if problem is not None:
            raise ValueError(problem)
        return token

    @field_validator("database_url")
    @classmethod
    def _a_database_url(cls, url: str) -> str:
        if not DATABASE_URL.match(url):
            raise ValueError(
                "not a database URL (dialect[+driver]://..., e.g. sqlite:///packtune.db or "
                "postgresql://user@host/db)"
            )
        return url

    @field_validator("redis_url")
    @classmethod
    def _a_redis_url(cls, url: str | None) -> str | None:
        if url is not None and not url.startswith(REDIS_SCHEMES):
            raise ValueError(f"not a Redis URL (it starts with one of {', '.join(REDIS_SCHEMES)})")
        return url


def _one_line(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        field = str(err["loc"][0]) if err["loc"] else "?"
        message = str(err["msg"]).removeprefix("Value error, ")  # pydantic's, for validators
        parts.append(f"{ENV_PREFIX}{field.upper()}: {message}")
    return "; ".join(parts)


def load_settings() -> Settings:
    """Read the settings afresh from the environment."""
    try:
        return Settings()
    except ValidationError as exc:
        raise SettingsError(_one_line(exc)) from None


@functools.cache
def get_settings() -> Settings:
    """The process-wide settings, read once."""
    return load_settings()
