"""Screenshot the dashboard of a finished study (the README's ``docs/dashboard.png``).

Runs ``packtune serve`` on a free port over a fresh SQLite database, submits the spec,
waits for the study to finish, and saves a full-page screenshot of its study page taken
by headless Chromium (Debian's ``/usr/bin/chromium`` driven by Playwright)::

    python bench/screenshot.py                      # examples/digits-mlp.yaml -> docs/dashboard.png
    python bench/screenshot.py --spec examples/digits-cnn.yaml --out /tmp/cnn.png
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for(what: str, check: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout:.0f} s")
        time.sleep(0.3)


#: one client for the polls (``httpx.get`` builds one per call: ~60 ms of CPU each)
HTTP = httpx.Client(timeout=10, limits=httpx.Limits(max_keepalive_connections=0))


def healthy(url: str) -> bool:
    try:
        return HTTP.get(f"{url}/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def screenshot(spec_path: Path, out: Path, width: int, timeout: float) -> Path:
    from playwright.sync_api import sync_playwright

    spec = yaml.safe_load(spec_path.read_text(encoding="utf-8"))
    with tempfile.TemporaryDirectory() as tmp:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PACKTUNE_")}
        env["PACKTUNE_DATABASE_URL"] = f"sqlite:///{Path(tmp) / 'packtune.db'}"
        env["PACKTUNE_CHECKPOINT_DIR"] = str(Path(tmp) / "checkpoints")
        env["PACKTUNE_LOG_LEVEL"] = "WARNING"
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        with open(Path(tmp) / "serve.log", "wb") as log:
            server = subprocess.Popen(
                [sys.executable, "-m", "service", "serve", "--port", str(port)],
                env=env,
                cwd=ROOT,
                stdout=log,
                stderr=log,
            )
        try:
            wait_for("the service start", lambda: healthy(url), 60)
            study = HTTP.post(f"{url}/api/studies", json=spec, timeout=30).json()
            print(f"study {study['id']} submitted; waiting for it to finish", file=sys.stderr)

            def finished() -> bool:
                status = HTTP.get(f"{url}/api/studies/{study['id']}", timeout=10).json()["status"]
                return status in ("completed", "failed", "cancelled")

            wait_for("the study's end", finished, timeout)
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
                page = browser.new_page(viewport={"width": width, "height": 900})
                page.goto(f"{url}/#/studies/{study['id']}")
                page.wait_for_selector("#live.idle", timeout=30_000)  # read in full
                out.parent.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(out), full_page=True)
                browser.close()
        finally:
            server.terminate()
            server.wait(10)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", type=Path, default=ROOT / "examples" / "digits-mlp.yaml")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "dashboard.png")
    parser.add_argument("--width", type=int, default=1400, help="viewport width, pixels")
    parser.add_argument("--timeout", type=float, default=600, help="seconds to wait for the study")
    args = parser.parse_args()
    print(screenshot(args.spec, args.out, args.width, args.timeout))


if __name__ == "__main__":
    main()
