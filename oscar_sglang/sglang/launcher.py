"""Start and stop a real SGLang server in a subprocess, for the quickstart, the benchmarks and the tests.

Imports no SGLang: the server runs in its own process group started with
``python -m sglang.launch_server``; :func:`local_server` waits for SGLang's
"fired up" log line, yields the base URL and kills the whole group on exit.
Where no GPU is visible the server runs SGLang's CPU engine
(``SGLANG_USE_CPU_ENGINE=1``, ``--device cpu``) and sleeps when idle.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from . import settings

READY_LINE = "The server is fired up"
START_TIMEOUT_S = 600
# Stopping a server's process group ends its scheduler first, which SGLang takes for a crash: with its crash
# diagnostics on (SGLang's default) it then sleeps 5 s "to let GPU activity settle" before looking for a live
# scheduler to py-spy or CUDA-coredump (none is left), so every stop took ~5.5 s instead of ~0.2 s.  The servers
# started here are stopped on purpose, so their diagnostics are off unless the environment given sets them; a
# real crash still shows as an exit code and the log's tail (:class:`ServerError`).
STOPPED_ON_PURPOSE = {"SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0"}


class ServerError(RuntimeError):
    """The server exited or did not become ready; the message ends with the tail of its log."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cuda_visible() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def launch_command(model, port: int, *extra: str, cpu: bool | None = None) -> list[str]:
    """``python -m sglang.launch_server`` for ``model`` on ``127.0.0.1:port``; CPU flags where no GPU is visible."""
    cpu = not cuda_visible() if cpu is None else cpu
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), "--host", "127.0.0.1",
           "--port", str(port)]
    if cpu:
        cmd += ["--device", "cpu", "--sleep-on-idle"]
    return cmd + list(extra)


# Environment-only knobs an operator sets around a script on purpose (the asset cache, the fixed KV budget,
# the extend and decode kernels' tiles, where decode graphs update the hot pool): they reach the server. The other
# OSCAR_SGLANG_* variables carry a launch's flags to its own subprocesses and must not leak into the next one.
PASSED_KNOBS = ("OSCAR_SGLANG_CACHE", settings.ENV_KV_BUDGET, settings.ENV_EXTEND_KERNEL, settings.ENV_DECODE_KERNEL,
                settings.ENV_GRAPH_HOT_UPDATE)


def server_env(cpu: bool | None = None, environ=os.environ) -> dict[str, str]:
    """The environment a user's server gets: no oscar settings or Triton interpreter leaking in from ours."""
    cpu = not cuda_visible() if cpu is None else cpu
    env = {k: v for k, v in environ.items()
           if (not k.startswith("OSCAR_SGLANG_") or k in PASSED_KNOBS) and k != "TRITON_INTERPRET"}
    if cpu:
        env["SGLANG_USE_CPU_ENGINE"] = "1"
    return env


def stop(proc: subprocess.Popen) -> None:
    """Terminate the server's whole process group (it was started in a session of its own)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def _tail(path: Path, n: int = 4000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else ""


@contextmanager
def local_server(model, log_path, *extra: str, cpu: bool | None = None, env: dict | None = None,
                 timeout_s: float = START_TIMEOUT_S):
    """Run a server until the block ends; yields its base URL. Raises :class:`ServerError` if it does not start."""
    log_path = Path(log_path)
    port = free_port()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(launch_command(model, port, *extra, cpu=cpu), stdout=log,
                                stderr=subprocess.STDOUT, env={**STOPPED_ON_PURPOSE, **(env or server_env(cpu))},
                                start_new_session=True)
    try:
        deadline = time.monotonic() + timeout_s
        while READY_LINE not in log_path.read_text(errors="replace"):
            if proc.poll() is not None:
                raise ServerError(f"server exited with {proc.returncode}:\n{_tail(log_path)}")
            if time.monotonic() > deadline:
                raise ServerError(f"server not ready after {timeout_s:.0f} s:\n{_tail(log_path)}")
            time.sleep(1)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc)


def refused(model, *extra: str, cpu: bool | None = None, timeout_s: float = 240) -> tuple[int, str]:
    """Launch a server that is expected to refuse to start; returns its exit code and output.

    Raises :class:`ServerError` if it is still running after ``timeout_s``.
    """
    proc = subprocess.Popen(launch_command(model, free_port(), *extra, cpu=cpu), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=server_env(cpu), start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise ServerError("the server started instead of refusing") from None
    finally:
        stop(proc)
    return proc.returncode, out


def post(url: str, path: str, body: dict, timeout_s: float = 600) -> dict:
    """POST JSON to the server and return the decoded answer."""
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.load(r)


def get(url: str, path: str, timeout_s: float = 60) -> dict:
    with urllib.request.urlopen(url + path, timeout=timeout_s) as r:
        return json.load(r)


def capacity(url: str) -> int:
    """The KV capacity in tokens the server reports (``/get_server_info``: ``max_total_num_tokens``)."""
    info = get(url, "/get_server_info")
    tokens = info.get("max_total_num_tokens")
    if tokens is None:  # the scheduler's fields sit under internal_states in some versions
        tokens = info["internal_states"][0]["max_total_num_tokens"]
    return int(tokens)


STARTUP_MARKER = "oscar-int2 KV cache:"
DECODE_LOOP_MARKER = "oscar_int2 decode loop:"   # the backend's line where it timed the decode loop (CUDA)


def startup_line(log_path, marker: str = STARTUP_MARKER) -> str | None:
    """What the plugin's startup line (``oscar-int2 KV cache: ...``), or another line of ``marker``, says in a
    server log (its first), or None."""
    for line in Path(log_path).read_text(errors="replace").splitlines():
        if marker in line:
            return line.split(marker, 1)[1].strip()
    return None


def flush_cache(url: str, timeout_s: float = 60, attempts: int = 30) -> None:
    """Empty the server's radix (prefix) cache.

    SGLang answers with plain text, and refuses (HTTP 400) while requests are
    still in flight, so this retries once a second.
    """
    for _ in range(attempts):
        req = urllib.request.Request(url + "/flush_cache", b"", method="POST")
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                r.read()
                return
        except urllib.error.HTTPError:
            time.sleep(1)
    raise ServerError(f"/flush_cache refused {attempts} times")
