# syntax=docker/dockerfile:1
# One image for every packtune process: api (`serve`), `scheduler`, `worker`, `db upgrade`.
#
# Base: python:3.11-slim plus torch from PyTorch's CUDA wheel index, rather than an
# nvidia/cuda image. The CUDA wheels bring their own CUDA runtime, cuDNN and NCCL as
# pip packages, so a CUDA base image would only add a second copy of the same
# libraries; the host's driver (libcuda, libnvidia-ml for NVML) is mounted into the
# container by the NVIDIA Container Toolkit when GPUs are requested.
#
# TORCH_CUDA picks the wheel variant. cu130 needs an NVIDIA driver >= 580 on the host;
# on an older driver build with a variant it supports, e.g. --build-arg TORCH_CUDA=cu128,
# if PyTorch publishes TORCH_VERSION for it.
FROM python:3.11-slim-bookworm

ARG TORCH_VERSION=2.13.0
ARG TORCH_CUDA=cu130
ARG APP_UID=10001

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility

# The largest layer first, so that code changes do not re-download it.
RUN pip install --index-url https://download.pytorch.org/whl/${TORCH_CUDA} torch==${TORCH_VERSION}

WORKDIR /opt/packtune

# Dependencies from pyproject.toml in their own layer (torch is already satisfied).
COPY pyproject.toml README.md ./
RUN python -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies'], sep='\n')" > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

COPY packtune ./packtune
COPY service ./service
COPY worker ./worker
COPY migrations ./migrations
# The import check runs outside the source folder, so it sees the installed package.
RUN pip install . \
    && cd / && python -c "import service.cli, packtune.workloads; assert 'digits-mlp' in packtune.workloads.registry()"

# Unprivileged user; it owns the checkpoint and data mount points and its state folder,
# so a fresh named volume mounted there inherits that ownership.
RUN useradd --uid ${APP_UID} --user-group --create-home --shell /usr/sbin/nologin packtune \
    && mkdir -p /checkpoints /data /var/lib/packtune \
    && chown packtune:packtune /checkpoints /data /var/lib/packtune

ENV PACKTUNE_CHECKPOINT_DIR=/checkpoints
USER packtune
WORKDIR /var/lib/packtune

EXPOSE 8000
# Meaningful for `serve` only; compose turns it off for the other commands.
HEALTHCHECK --interval=15s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=4)"]

ENTRYPOINT ["packtune"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
