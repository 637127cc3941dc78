"""A ``rolling-forcing serve`` process on a free loopback port, for the process and browser tests."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
START_S = 120.0  # model build + calibration on a busy 2-core machine


@contextmanager
def running_server(extra_args: Sequence[str] = (), log: list[str] | None = None) -> Iterator[str]:
    """Start ``python -m nki_ardiff serve --port 0 ...``, wait until it answers, yield its base URL
    (``http://127.0.0.1:PORT/``) and end the process afterwards. ``log``: receives the server's output
    lines (stdout and stderr) as they come."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "nki_ardiff", "serve", "--port", "0", *extra_args]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    drainer: threading.Thread | None = None
    try:
        assert proc.stdout is not None
        stdout = proc.stdout
        url = None
        for _ in range(50):  # the URL line comes first, after any import-time warnings
            line = stdout.readline()
            if log is not None:
                log.append(line)
            m = re.search(r"open (http://127\.0\.0\.1:\d+/)", line)
            if m:
                url = m.group(1)
                break
        assert url, "the server printed no URL"

        def drain() -> None:  # keep reading the server's log, so it never blocks on a full pipe
            for line in stdout:
                if log is not None:
                    log.append(line)

        drainer = threading.Thread(target=drain, daemon=True)
        drainer.start()
        t_end = time.monotonic() + START_S
        while True:  # the app answers once the model is built and calibrated
            try:
                if httpx.get(url, timeout=5.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < t_end and proc.poll() is None, "server did not come up"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        if drainer is not None:
            drainer.join(timeout=10)  # the log's last lines (EOF once the process is gone)
