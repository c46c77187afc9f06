"""Running one vLLM engine helper script as a child process (tests only).

Every engine test starts its engine in a process of its own (vLLM keeps
global state), with vLLM's default logging and nothing from the caller's
ecstore/LMCache environment, and kills the whole process group afterwards
(engine-core and worker children included).
"""

from __future__ import annotations

import os
import signal
import subprocess

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
