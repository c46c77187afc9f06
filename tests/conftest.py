"""Shared, generic test fixtures for ecstore.

Keep this small: fixtures that several test files need go here; anything
specific to one file stays in that file.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Helper modules imported by tests get pytest's assertion introspection too.
pytest.register_assert_rewrite("ecstore.testing.store_contract", "ecstore.testing.tensors", "helpers")

GIB = 1 << 30


def gib(nbytes: int | float) -> float:
    """``nbytes`` bytes as a GiB float (what ECStoreConfig sizes are in).

    Exact for integers below 2**53: ``int(gib(n) * 2**30) == n``.
    """
    return nbytes / GIB


@pytest.fixture
def tmp_store_dir(tmp_path: Path) -> Path:
    """A fresh, not yet existing directory for an LMDB store."""
    return tmp_path / "store"


@pytest.fixture(autouse=True)
def _ecstore_logs_to_caplog(caplog: pytest.LogCaptureFixture):
    """Let INFO records of the ``ecstore`` logger reach ``caplog``."""
    from ecstore.testing.store_contract import ecstore_info_to_caplog  # after the assert-rewrite registration

    with ecstore_info_to_caplog(caplog):
        yield


# ---------------------------------------------------------------------------
# vLLM connector tests (tests/test_connector_*.py)
# ---------------------------------------------------------------------------
# The tiny random BLIP-2 that the real vLLM (CPU build) serves. Built once
# into the repository's .cache/ (gitignored); ecstore.testing.tiny_model reuses a
# finished build whose marker matches and locks concurrent builds.

@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    from ecstore.testing import tiny_model

    repo = Path(__file__).resolve().parents[1]

    return tiny_model.build_tiny_blip2(repo / ".cache" / "tiny_blip2")


# The tiny random Qwen models (ecstore.testing.tiny_qwen), built once each
# into .cache/tiny_<name> the same way; a test asks only for the ones it runs.

def _tiny_qwen_dir(name: str) -> Path:
    from ecstore.testing import tiny_qwen

    return tiny_qwen.build_tiny_qwen(name, Path(__file__).resolve().parents[1] / ".cache" / f"tiny_{name}")


@pytest.fixture(scope="session")
def tiny_qwen2_5_vl_dir() -> Path:
    """Tiny Qwen2.5-VL (image, video)."""
    return _tiny_qwen_dir("qwen2_5_vl")


@pytest.fixture(scope="session")
def tiny_qwen3_vl_dir() -> Path:
    """Tiny Qwen3-VL with deepstack (encoder output 384 wide, LM 128)."""
    return _tiny_qwen_dir("qwen3_vl")


@pytest.fixture(scope="session")
def tiny_qwen2_audio_dir() -> Path:
    """Tiny Qwen2-Audio (audio)."""
    return _tiny_qwen_dir("qwen2_audio")


@pytest.fixture(scope="session")
def tiny_qwen2_5_omni_dir() -> Path:
    """Tiny Qwen2.5-Omni thinker (image, video, audio, video with its audio)."""
    return _tiny_qwen_dir("qwen2_5_omni")


@pytest.fixture
def no_lmcache_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Remove every ``LMCACHE_*`` variable (config file, ``LMCACHE_EC_*``...)
    of the environment the suite runs in, so only the test configures ecstore."""
    for var in list(os.environ):
        if var.startswith("LMCACHE_"):
            monkeypatch.delenv(var)


# ---------------------------------------------------------------------------
# Remote tier tests (tests/test_remote*.py): a real redis-server
# ---------------------------------------------------------------------------

#: ``remote_timeout_seconds`` of the tests whose remote is a healthy real
#: server (seconds). The default 0.5 s bounds a call as a whole, connecting
#: included: on this busy 2-core machine a TLS cluster's first write (its
#: client's set-up: TLS contexts, CLUSTER SLOTS, COMMAND) took 0.5-0.7 s and
#: was dropped. Tests of the timeout itself set their own.
HEALTHY_REMOTE_TIMEOUT_S = 30.0


@pytest.fixture
def redis_server(tmp_path: Path):
    """A real redis-server on 127.0.0.1 (free port, own temp dir), killed afterwards."""
    from ecstore.testing.redis_server import RedisServer

    server = RedisServer(tmp_path / "redis")
    server.workdir.mkdir()
    server.start()
    yield server
    server.kill()


@pytest.fixture
def engines():
    """``make(vllm_config, runner="v1") -> Engine``: vLLM's real Scheduler plus the worker
    connector (tests/helpers/scheduler_engine.py; ``runner="v2"``: driven through
    Model Runner V2's EC code, helpers/v2_runner.py); every engine made is closed
    at teardown."""
    from helpers.scheduler_engine import Engine

    made: list[Engine] = []

    def make(cfg, runner: str = "v1") -> Engine:
        made.append(Engine(cfg, runner))
        return made[-1]

    yield make
    for eng in made:
        eng.close()


@pytest.fixture
def connectors(tiny_model_dir: Path):
    """``connectors(role, extra) -> (scheduler connector, worker connector)``,
    created by vLLM's factory from a real VllmConfig of the tiny model
    (``role``: ec_producer / ec_consumer / ec_both; ``extra``: the
    connector's extra config); every connector made is shut down afterwards."""
    yield from _connectors(tiny_model_dir)


@pytest.fixture
def qwen_connectors(tiny_qwen2_5_vl_dir: Path):
    """``connectors`` of the tiny Qwen2.5-VL: the model whose metadata-only
    items (an EPD consumer's) the doubles come from
    (``vo.make_request(..., inputs=False)``)."""
    yield from _connectors(tiny_qwen2_5_vl_dir)


def _connectors(model_dir: Path):
    from helpers import vllm_objects as vo
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    from ecstore.connector import ECStoreConnector

    made: list[ECStoreConnector] = []

    def make(role: str, extra: dict) -> tuple[ECStoreConnector, ECStoreConnector]:
        cfg = vo.vllm_config(model_dir, role, extra)
        sched = ECConnectorFactory.create_connector(config=cfg, role=ECConnectorRole.SCHEDULER)
        worker = ECConnectorFactory.create_connector(config=cfg, role=ECConnectorRole.WORKER)
        made.extend([sched, worker])
        assert isinstance(sched, ECStoreConnector) and isinstance(worker, ECStoreConnector)
        return sched, worker

    yield make
    for conn in made:
        conn.shutdown()
