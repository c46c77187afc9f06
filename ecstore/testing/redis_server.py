"""A real redis-server for tests and benchmarks: 127.0.0.1, a free port, its own dir.

Started and stopped by the ``redis_server`` fixture (tests/conftest.py) and by
tools/bench_remote.py. The binary comes from Debian's ``redis-server`` package
(tools/setup_env.sh installs it when it runs as root); a missing binary is a
RuntimeError with a clear message (a failed test, never a skip).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

START_TIMEOUT_S = 60.0


def redis_binary() -> str:
    path = shutil.which("redis-server") or shutil.which("valkey-server")
    if path is None:
        raise RuntimeError("redis-server is not installed: run tools/setup_env.sh as root, or "
                           "`apt-get install -y redis-server` (the remote-tier tests need a real server)")
    return path


#: A cluster node also listens on its port + this (the cluster bus).
CLUSTER_BUS_OFFSET = 10000


def _bound_port(port: int = 0) -> int | None:
    """Bind 127.0.0.1:``port`` (0: any) and release it; the port, or None if taken."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return None
        return int(s.getsockname()[1])


def free_port(*, bus_offset: int | None = None) -> int:
    """A TCP port on 127.0.0.1 free right now; with ``bus_offset``, one whose
    port + ``bus_offset`` is a valid port and free too (a cluster node's bus:
    an ephemeral port above 55535 has none, and redis-server exits)."""
    for _ in range(200):
        port = _bound_port()
        assert port is not None
        if bus_offset is None or (port + bus_offset <= 65535 and _bound_port(port + bus_offset) is not None):
            return port
    raise RuntimeError("no free port pair found on 127.0.0.1")


@dataclass
class RedisServer:
    """One redis-server process. ``start``/``kill``/``restart`` keep the port."""

    workdir: Path
    port: int = 0
    password: str | None = None
    extra: list[str] = field(default_factory=list)
    proc: subprocess.Popen | None = None
    #: (certificate, key) PEM files: serve TLS only (the certificate is its own CA).
    tls: tuple[Path, Path] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        if self.tls:
            return f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_ca_certs={self.tls[0]}"
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def client(self) -> Any:
        import redis

        tls: dict[str, Any] = {"ssl": True, "ssl_ca_certs": str(self.tls[0])} if self.tls else {}
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=10, **tls)

    def _launch(self) -> bool:
        ports = ["--port", str(self.port)]
        if self.tls:
            ports = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(self.tls[0]),
                     "--tls-key-file", str(self.tls[1]), "--tls-ca-cert-file", str(self.tls[0]),
                     "--tls-auth-clients", "no"]
        args = [redis_binary(), *ports, "--bind", "127.0.0.1", "--dir", str(self.workdir),
                "--save", "", "--appendonly", "no", "--daemonize", "no", "--loglevel", "warning",
                "--protected-mode", "no", "--logfile", str(self.workdir / f"redis-{self.port}.log")]
        if self.password:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(args + self.extra, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if self._wait_ready():
            return True
        self.kill()
        return False

    def start(self) -> RedisServer:
        """Start on a free port (retried: another process may take a port first)."""
        cluster = "--cluster-enabled" in self.extra
        for _ in range(5):
            self.port = free_port(bus_offset=CLUSTER_BUS_OFFSET if cluster else None)
            if self._launch():
                return self
        raise RuntimeError(f"redis-server did not start; see {self.workdir}")

    def _wait_ready(self) -> bool:
        """Poll (bounded) until the server answers PING or the process exited."""
        import redis

        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                return False
            try:
                if self.client().ping():
                    return True
            except redis.RedisError:
                pass
            time.sleep(0.02)  # polling a condition with a bound, not synchronisation
        return False

    def kill(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self.proc = None

    def restart(self) -> None:
        """Kill (if running) and start again on the same port: an empty server."""
        self.kill()
        if not self._launch():
            raise RuntimeError(f"redis-server did not restart on port {self.port}; see {self.workdir}")


def start_cluster(workdir: Path, masters: int = 3) -> list[RedisServer]:
    """``masters`` redis-servers in cluster mode, joined with ``redis-cli --cluster
    create`` (no replicas); returns once every node reports ``cluster_state:ok``."""
    nodes = []
    try:
        for i in range(masters):
            d = workdir / f"node{i}"
            d.mkdir(parents=True)
            nodes.append(RedisServer(d, extra=["--cluster-enabled", "yes", "--cluster-config-file",
                                               str(d / "nodes.conf"), "--cluster-node-timeout", "5000"]).start())
        cli = shutil.which("redis-cli") or shutil.which("valkey-cli")
        if cli is None:
            raise RuntimeError("redis-cli is not installed (Debian package redis-tools, a dependency of "
                               "redis-server)")
        subprocess.run([cli, "--cluster", "create", *[f"127.0.0.1:{n.port}" for n in nodes],
                        "--cluster-replicas", "0", "--cluster-yes"], check=True, timeout=120,
                       stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not all(b"cluster_state:ok" in n.client().execute_command("CLUSTER", "INFO") for n in nodes):
            if time.monotonic() > deadline:
                raise RuntimeError("the redis cluster did not reach cluster_state:ok")
            time.sleep(0.05)  # polling a condition with a bound
        return nodes
    except BaseException:
        for n in nodes:
            n.kill()
        raise


def self_signed_cert(workdir: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 (its own CA) and its key, made with the openssl CLI."""
    cert, key = workdir / "cert.pem", workdir / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "2", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, timeout=60, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return cert, key
