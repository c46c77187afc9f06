"""An encoder-decoder model (Whisper) with the connector: vLLM's model
runners skip the EC connector's context for such models (no load ever runs),
while its scheduler still asks ``has_cache_item``; ecstore must answer no so
that the encoder runs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import vllm_objects as vo
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.engine.input_processor import InputProcessor
from vllm.v1.request import Request

from ecstore.testing import tiny_whisper

pytestmark = pytest.mark.vllm


@pytest.fixture(autouse=True)
def _no_outside_config(no_lmcache_env):
    """Only the test's ec_connector_extra_config configures the connector."""


@pytest.fixture(scope="module")
def whisper_dir() -> Path:
    return tiny_whisper.build_tiny_whisper(Path(__file__).resolve().parents[2] / ".cache" / "tiny_whisper")


def _request(cfg, req_id: str, uuid: str) -> Request:
    """The Request vLLM's engine core gets for one audio clip with a client uuid."""
    audio = (np.sin(np.arange(16000) / 7.0).astype(np.float32), 16000)
    prompt = {"encoder_prompt": {"prompt": "", "multi_modal_data": {"audio": audio},
                                 "multi_modal_uuids": {"audio": [uuid]}},
              "decoder_prompt": tiny_whisper.DECODER_PROMPT}
    return vo.request_from_prompt(InputProcessor(cfg), req_id, prompt, max_tokens=2)


def test_an_encoder_decoder_models_stored_item_is_encoded_not_announced_as_a_load(
        whisper_dir, tmp_path, caplog):
    """Regression: with client uuids shared, a stored Whisper clip got a yes;
    vLLM then scheduled no encoder for it and the load was never run (the
    decoder would read no encoder output)."""
    ec = vo._ec_config("ec_both")
    ec.ec_connector_extra_config = {"local_disk": str(tmp_path / "ec"), "max_local_disk_size": 0.05,
                                    "local_cpu": False, "share_client_uuids": True}
    cfg = EngineArgs(**tiny_whisper.engine_kwargs(whisper_dir, ec_transfer_config=ec)).create_engine_config()
    assert cfg.model_config.is_encoder_decoder
    request = _request(cfg, "r1", "clip-0001")
    (feature,) = request.mm_features
    assert feature.identifier == "clip-0001"
    scheduler = vo.make_scheduler(cfg)
    worker = ECConnectorFactory.create_connector(config=cfg, role=ECConnectorRole.WORKER)
    try:
        # As V1's encoder-decoder path saves an encoder output (outside the connector's context).
        worker.save_caches({feature.identifier: torch.randn(request.get_num_encoder_embeds(0), 64)},
                           feature.identifier)
        worker.worker_side.store.flush()
        assert worker.worker_side.store.contains(feature.identifier)
        scheduler.add_request(request)
        out = scheduler.schedule()
        assert out.scheduled_encoder_inputs == {"r1": [0]}, "the stored clip was not encoded"
        assert out.ec_connector_metadata.loads == []
        assert "is an encoder-decoder model" in caplog.text  # the operator is told, once at start
    finally:
        scheduler.shutdown()
        worker.shutdown()
