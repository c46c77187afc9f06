"""Process and HTTP helpers for ``tools/demo.py`` (stdlib and ecstore.testing).

* :class:`Server` starts ``python -m vllm.entrypoints.openai.api_server`` in its
  own session (process group), with stdout/stderr going to a log file, waits for
  ``/health`` with a bounded deadline (showing elapsed seconds), and stops the
  whole process group by its id (SIGTERM, then SIGKILL after a grace period).
  Every started server is registered in ``LIVE`` until it is stopped, so the
  demo's ``finally`` and signal handlers can stop whatever is still running.
* :func:`stream_chat` sends one streaming chat-completion request and measures
  time-to-first-token: from just before the request is sent to the first
  streamed chunk that carries generated tokens (text or token ids).
* :func:`scrape_ec_counters` reads the ``vllm:ec_store_*_total`` counters from
  ``/metrics``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ecstore.testing.procs import group_members

__all__ = [
    "LIVE",
    "Server",
    "ServerError",
    "free_port",
    "http_get",
    "scrape_ec_counters",
    "stop_all",
    "stream_chat",
    "stream_chat_concurrent",
]


class ServerError(RuntimeError):
    """The server did not start (or died); the message holds the log's tail."""


#: pid -> Server, for every server started and not yet stopped.
LIVE: dict[int, Server] = {}


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (bind to port 0, read it back)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def _die_with_parent() -> None:  # runs in the child between fork and exec
    """Linux: SIGTERM the server if the demo itself dies (even by SIGKILL)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001
        pass


class Server:
    """One vLLM OpenAI-compatible server process (and its children)."""

    def __init__(self, name: str, argv: Sequence[str], env: dict[str, str], log_path: Path,
                 host: str, port: int, cwd: str | os.PathLike[str] | None = None) -> None:
        self.name = name
        self.argv = list(argv)
        self.env = env
        self.log_path = Path(log_path)
        self.host = host
        self.port = port
        self.cwd = cwd
        self.proc: subprocess.Popen | None = None
        self.pid: int | None = None
        self.pgid: int | None = None
        self.started_at: float | None = None
        self.startup_s: float | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # ----------------------------------------------------------------- start
    def start(self) -> None:
        if port_in_use(self.host, self.port):
            raise ServerError(f"port {self.port} on {self.host} is already in use; "
                              f"pick another with --port")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")
        try:
            self.started_at = time.monotonic()
            self.proc = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=self.env, cwd=self.cwd, start_new_session=True,
                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
            )
        finally:
            log.close()  # the child holds its own copy of the descriptor
        self.pid = self.pgid = self.proc.pid  # new session: group id == leader's pid
        LIVE[self.pid] = self

    def wait_healthy(self, timeout: float, tick: Callable[[float], None] | None = None) -> float:
        """Poll ``/health`` until it answers 200; returns seconds since start.

        Raises :class:`ServerError` (with the log's last lines) when the process
        exits or ``timeout`` seconds pass.
        """
        assert self.proc is not None and self.started_at is not None
        deadline = self.started_at + timeout
        while True:
            elapsed = time.monotonic() - self.started_at
            code = self.proc.poll()
            if code is not None:
                raise ServerError(f"vLLM server ({self.name}) exited with status {code} while "
                                  f"starting; last lines of {self.log_path}:\n{self.log_tail(40)}")
            try:
                status, _ = http_get(self.base_url + "/health", timeout=2.0)
                if status == 200:
                    self.startup_s = elapsed
                    return elapsed
            except (OSError, urllib.error.URLError):
                pass
            if time.monotonic() > deadline:
                raise ServerError(f"vLLM server ({self.name}) not healthy after {timeout:.0f} s; "
                                  f"last lines of {self.log_path}:\n{self.log_tail(40)}")
            if tick is not None:
                tick(elapsed)
            time.sleep(0.5)  # polling interval of a bounded wait, not synchronisation

    # ------------------------------------------------------------------ stop
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def group_members(self) -> list[int]:
        """Live (non-zombie) processes of the server's process group."""
        if self.pgid is None:
            return []
        return group_members(self.pgid)

    def stop(self, grace: float = 30.0) -> None:
        """SIGTERM the process group, wait up to ``grace`` s, then SIGKILL what is left."""
        if self.proc is None or self.pgid is None:
            return
        if self.group_members():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pgid, signal.SIGTERM)
            end = time.monotonic() + grace
            while self.group_members() and time.monotonic() < end:
                self.proc.poll()  # reap the leader as soon as it exits
                time.sleep(0.1)
            if self.group_members():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.pgid, signal.SIGKILL)
                end = time.monotonic() + 10.0
                while self.group_members() and time.monotonic() < end:
                    self.proc.poll()
                    time.sleep(0.1)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        # Only now: if this was interrupted, stop_all() still finds the server and retries.
        LIVE.pop(self.pid, None)

    # ------------------------------------------------------------------- log
    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, n: int = 30) -> str:
        lines = self.log_text().splitlines()
        return "\n".join("    | " + line for line in lines[-n:])


def stop_all() -> list[int]:
    """Stop every server still registered; returns their pids."""
    stopped = []
    for pid, server in list(LIVE.items()):
        try:
            server.stop()
        except Exception as e:  # keep going: stop the others  # noqa: BLE001
            print(f"warning: could not stop server pid {pid}: {e}", file=sys.stderr)
        stopped.append(pid)
    return stopped


# ---------------------------------------------------------------------- HTTP
def http_get(url: str, timeout: float = 10.0) -> tuple[int, bytes]:
    req = urllib.request.Request(url, method="GET")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def stream_chat(base_url: str, model: str, content: list[dict[str, Any]], *, max_tokens: int,
                timeout: float = 300.0) -> dict[str, Any]:
    """One streaming chat completion (greedy); returns timing and the tokens.

    ``send`` and ``first`` are ``time.perf_counter()`` values: just before the
    request is sent, and when the first chunk carrying generated tokens (text
    or token ids) arrived. ``ttft_s = first - send``.
    """
    body = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "stream": True,
        "temperature": 0.0,
        "max_tokens": max_tokens,
        "ignore_eos": True,        # vLLM extension: always max_tokens tokens
        "return_token_ids": True,  # vLLM extension: token ids in every chunk
        "seed": 0,
    }
    data = json.dumps(body).encode()
    req = urllib.request.Request(base_url + "/v1/chat/completions", data=data, method="POST",
                                 headers={"Content-Type": "application/json",
                                          "Accept": "text/event-stream"})
    token_ids: list[int] = []
    text = ""
    first = None
    send = time.perf_counter()
    try:
        resp = urllib.request.urlopen(req, timeout=timeout)
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")[:500]
        raise RuntimeError(f"chat completion failed: HTTP {e.code}: {detail}") from None
    with resp:
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                break
            chunk = json.loads(payload)
            if "error" in chunk:
                raise RuntimeError(f"chat completion failed mid-stream: {chunk['error']}")
            for choice in chunk.get("choices", []):
                ids = choice.get("token_ids") or []
                delta = (choice.get("delta") or {}).get("content") or ""
                if first is None and (ids or delta):
                    first = time.perf_counter()
                token_ids.extend(ids)
                text += delta
    end = time.perf_counter()
    if first is None:
        raise RuntimeError("chat completion streamed no tokens")
    return {"send": send, "first": first, "end": end, "ttft_s": first - send,
            "total_s": end - send, "token_ids": token_ids, "text": text}


def stream_chat_concurrent(base_url: str, model: str, contents: list[list[dict[str, Any]]], *,
                           max_tokens: int, timeout: float = 300.0) -> list[dict[str, Any]]:
    """Send several streaming requests at once (one thread each)."""
    results: list[Any] = [None] * len(contents)
    barrier = threading.Barrier(len(contents))

    def one(i: int) -> None:
        try:
            barrier.wait(timeout=30)
            results[i] = stream_chat(base_url, model, contents[i], max_tokens=max_tokens,
                                     timeout=timeout)
        except BaseException as e:  # reported by the caller  # noqa: BLE001
            results[i] = e

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(contents))]
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():  # join in slices so Ctrl-C reaches the main thread
            t.join(0.2)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


_COUNTER = re.compile(r"^vllm:ec_store_([a-z_]+)_total(?:\{[^}]*\})?\s+([0-9.eE+-]+)\s*$")


def scrape_ec_counters(base_url: str) -> dict[str, float]:
    """``vllm:ec_store_<name>_total`` counters from ``/metrics`` (summed over labels)."""
    status, body = http_get(base_url + "/metrics", timeout=10.0)
    if status != 200:
        raise RuntimeError(f"/metrics answered HTTP {status}")
    out: dict[str, float] = {}
    for line in body.decode(errors="replace").splitlines():
        m = _COUNTER.match(line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out
