"""Running one vLLM engine helper script as a child process (tests only).

Every engine test starts its engine in a process of its own (vLLM keeps
global state), with vLLM's default logging and nothing from the caller's
ecstore/LMCache environment, and kills the whole process group afterwards
(engine-core and worker children included).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

#: Environment variables the caller may have set that would change what the engine logs or reads.
_DROPPED = ("LMCACHE_", "VLLM_LOGGING", "VLLM_CONFIGURE_LOGGING", "VLLM_ENABLE_V1_MULTIPROCESSING",
            "VLLM_LOG_STATS_INTERVAL")


def engine_env(*, log_stats: bool = True) -> dict[str, str]:
    """The child's environment: the caller's minus ecstore/LMCache/vLLM logging
    settings; with ``log_stats`` the stats line is logged at every step."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_DROPPED)}
    if log_stats:
        env["VLLM_LOG_STATS_INTERVAL"] = "0.001"
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return env


def run_engine(cmd: list[str], name: str, cwd: str | os.PathLike, env: dict[str, str],
               timeout: float = 420) -> str:
    """Run ``cmd`` to completion and return its console (stdout + stderr).

    Fails the test (with the console's tail) on a timeout, a non-zero exit or
    a traceback; the child's process group is killed in every case."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        console, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        console, _ = proc.communicate()
        pytest.fail(f"engine run {name!r} timed out after {timeout}s:\n{console[-6000:]}")
    finally:
        try:  # leave nothing behind (engine-core / worker children)
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, f"engine run {name!r} failed (rc={proc.returncode}):\n{console[-6000:]}"
    assert "Traceback" not in console, console[-6000:]
    return console


class EngineProcess:
    """A long-lived engine child speaking JSON lines: commands on its stdin,
    one answer line each on its stdout, its log (stderr) in ``log``.

    The environment drops the caller's LMCache/vLLM settings but keeps the
    platform choice (tools/vllm033.sh sets ``VLLM_TARGET_DEVICE=cpu``: 0.33's
    Python package cannot tell it is on a CPU build). A child that does not
    answer within the timeout fails the test with its log's tail."""

    start_timeout_s = 900.0  # several engines start at once on 2 busy cores
    cmd_timeout_s = 600.0

    def __init__(self, cmd: list[str], log: Path) -> None:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("LMCACHE_", "VLLM_")) or k == "VLLM_TARGET_DEVICE"}
        env["VLLM_CPU_KVCACHE_SPACE"] = "1"
        self.log = log
        self._log_file = open(log, "w")
        self.proc = subprocess.Popen(cmd, env=env, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log_file, start_new_session=True)

    def read(self, timeout: float | None = None) -> dict[str, Any]:
        """The next answer line (``cmd_timeout_s`` by default)."""
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], self.cmd_timeout_s if timeout is None else timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.kill()
            pytest.fail(f"engine gave no answer (rc={self.proc.poll()}):\n{self.log.read_text()[-6000:]}")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def write(self, cmd: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def send(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Send one command and return its answer."""
        self.write(cmd)
        return self.read()

    def wait_ready(self) -> None:
        assert self.read(self.start_timeout_s) == {"ready": True}

    def close(self) -> None:
        """Ask the child to exit (it must answer ``{"exited": True}``), then
        kill its process group whatever it did."""
        try:
            if self.proc.poll() is None:
                try:
                    assert self.send({"op": "exit"}) == {"exited": True}
                    self.proc.wait(timeout=120)
                finally:
                    self.kill()
        finally:
            self._log_file.close()

    def kill(self) -> None:
        try:  # the whole group: engine-core and worker children too
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
