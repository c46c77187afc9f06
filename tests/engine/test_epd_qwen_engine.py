"""E -> PD with real engines of the tiny Qwen2.5-VL, Qwen3-VL (deepstack),
Qwen2-Audio and Qwen2.5-Omni thinker (an image and an audio clip in each
request): an encode-only ``ec_producer`` and an ``ec_consumer`` in separate
processes sharing one ``local_disk`` (tests/helpers/epd_qwen_engine.py),
items named by the proxy's ``multi_modal_uuids`` (``share_client_uuids``),
the consumer sent metadata-only items (no pixels, no waveform) as an EPD
proxy sends them: the fields each model's vLLM parser declares as
placeholder metadata (``embedding_fields``): ``image_grid_thw`` (images),
``audio_num_tokens`` (Qwen2-Audio), ``audio_feature_lengths`` (Omni audio).

What must hold, per model: an item the producer stored reaches the
consumer's language model bit-equal to the consumer's own encoding of the
same inputs (its encoder ran on a miss, without ecstore's part) and the
consumer's encoders do not run; a metadata-only item nobody stored, or
whose entry is unreadable, fails its request (finish reason ``error``, vLLM's
retryable request error) before any token, and the engine serves the next
request; an entry damaged after the scheduler verified it (the zero
stand-in path, 384 wide for Qwen3-VL) fails its request a step late. Once in vLLM's default
multi-process engine (where the old failure was ``EngineDeadError`` for
every later request): Qwen2.5-VL's consumer also runs there.

Two single-process engines per model (plus the multi-process one for
Qwen2.5-VL), started together; every scenario runs on the same engines.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from helpers.engine_proc import EngineProcess

from ecstore import ECStore, ECStoreConfig
from ecstore.identity import EncoderIdentity

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

HELPER = Path(__file__).resolve().parents[1] / "helpers" / "epd_qwen_engine.py"
#: Image side per model giving an 8 x 8 patch grid (16 embeddings): 14- and 16-pixel patches.
SIZE = {"qwen2_5_vl": 112, "qwen3_vl": 128, "qwen2_5_omni": 112}
GRID = [1, 8, 8]
#: The items of one request, per model: Omni's carry an image and an audio clip.
MODALITIES = {"qwen2_5_vl": ("image",), "qwen3_vl": ("image",), "qwen2_audio": ("audio",),
              "qwen2_5_omni": ("image", "audio")}
#: 1 s of audio: 100 mel frames (hop 160 at 16 kHz), 25 encoder outputs after the two stride-2 stages.
MEL_FRAMES = 100
AUDIO_TOKENS = 25
#: What a metadata-only item carries, per model and modality: the fields the
#: model's vLLM parser declares as placeholder metadata (``embedding_fields``).
METADATA = {"image": {"modality": "image", "image_grid_thw": GRID},
            "qwen2_audio": {"modality": "audio", "audio_num_tokens": AUDIO_TOKENS},
            "qwen2_5_omni": {"modality": "audio", "audio_feature_lengths": MEL_FRAMES}}

class Engine(EngineProcess):
    """One engine process (tests/helpers/epd_qwen_engine.py)."""

    def __init__(self, name: str, model_dir: Path, role: str, extra: dict, log: Path, multiprocess: bool = False):
        super().__init__([sys.executable, str(HELPER), "--name", name, "--model", str(model_dir), "--role", role,
                          "--extra", json.dumps(extra)] + (["--multiprocess"] if multiprocess else []), log)

    def generate(self, *items: dict) -> list[dict]:
        results = self.send({"op": "generate", "requests": list(items)})["results"]
        for r in results:
            assert "raised" not in r, f"the engine died: {r['raised']}\n{self.log.read_text()[-4000:]}"
        return results

    def reset_encoder_cache(self) -> None:
        assert self.send({"op": "reset_encoder_cache"}) == {"ok": True}

    def close(self) -> None:
        try:  # an engine that does not answer its exit is killed; the scenarios judged it already
            super().close()
        except Exception:  # noqa: BLE001
            self.kill()


def pixels(name: str, seed: int, uuid: str) -> list[dict]:
    """A request with inputs: one item per modality of ``name`` (``uuid.image``, ``uuid.audio``)."""
    return [{"image": seed, "size": SIZE[name], "uuid": f"{uuid}.image"} if m == "image"
            else {"audio": seed, "uuid": f"{uuid}.audio"} for m in MODALITIES[name]]


def metadata_only(name: str, uuid: str) -> list[dict]:
    """The same request metadata-only, as an EPD proxy sends it to a consumer."""
    return [{"metadata": METADATA["image" if m == "image" else name], "uuid": f"{uuid}.{m}"}
            for m in MODALITIES[name]]


def damage(store_dir: Path, model_dir: Path, name: str, uuid: str) -> None:
    """Flip the last byte of the stored blob of each item of request ``uuid``
    (records unchanged), under the identity the engines registered in the
    store's namespaces table."""
    cfg = ECStoreConfig(local_disk=str(store_dir), max_local_disk_size=0.05, local_cpu=False)
    with ECStore(cfg, model=str(model_dir), dtype=torch.float32) as probe:
        descriptions = probe.disk.namespace_descriptions()
    (desc,) = [json.loads(d) for d in descriptions.values() if json.loads(d)["model"] == str(model_dir)]
    with ECStore(cfg, model=str(model_dir), dtype=torch.float32,
                 identity=EncoderIdentity.from_description(desc)) as st:
        for m in MODALITIES[name]:
            key = st.key(f"{uuid}.{m}")
            blob = bytearray(st.disk.blob_bytes(key))
            blob[-1] ^= 0xFF
            with st.disk.env.begin(write=True) as txn:
                txn.put(key.encode(), bytes(blob), db=st.disk._dbs.blobs)


def assert_failed_before_any_token(result: dict) -> None:
    assert result["finish"] == "error" and result["tokens"] == [], result


@pytest.mark.parametrize("name", list(MODALITIES))
def test_producer_and_metadata_only_consumer(name, request, tmp_path):
    model_dir = request.getfixturevalue(f"tiny_{name}_dir")
    store = tmp_path / "ec"
    # No memory tier: a load reads the shared file (where the damage is).
    extra = {"local_disk": str(store), "max_local_disk_size": 0.05, "local_cpu": False, "share_client_uuids": True}
    engines = {"P": Engine(name, model_dir, "ec_producer", extra, tmp_path / "p.log"),
               "C": Engine(name, model_dir, "ec_consumer", extra, tmp_path / "c.log")}
    if name == "qwen2_5_vl":
        engines["M"] = Engine(name, model_dir, "ec_consumer", extra, tmp_path / "m.log", multiprocess=True)
    try:
        for eng in engines.values():
            eng.wait_ready()
        P, C = engines["P"], engines["C"]
        # The consumer encodes image 1 itself (nothing stored yet): the reference.
        (ref,) = C.generate(pixels(name, 1, "own-1"))
        n = len(MODALITIES[name])
        assert ref["finish"] == "length" and ref["encoded"] == n and len(ref["embeds"]) == n
        # The producer encodes and stores images 1, 2 and 3 under the proxy's uuids.
        done = P.generate(pixels(name, 1, "img-1"), pixels(name, 2, "img-2"), pixels(name, 3, "img-3"))
        assert [r["encoded"] for r in done] == [n, n, n]

        # Stored -> loaded: bit-equal to the consumer's own encoding, its tower idle.
        one, two = C.generate(metadata_only(name, "img-1"), metadata_only(name, "img-2"))
        assert one["finish"] == two["finish"] == "length"
        assert one["encoded"] == two["encoded"] == 0
        assert one["embeds"] == ref["embeds"]
        assert two["embeds"] != ref["embeds"]

        # Missing: that request fails before any token; the engine serves the next one.
        missing, after = C.generate(metadata_only(name, "nobody-stored-this"), pixels(name, 4, "own-4"))
        assert_failed_before_any_token(missing)
        assert after["finish"] == "length" and after["encoded"] == n

        # Unreadable at load (damaged before the consumer ever read it): fails, engine lives.
        damage(store, model_dir, name, "img-3")
        bad, after = C.generate(metadata_only(name, "img-3"), metadata_only(name, "img-1"))
        assert_failed_before_any_token(bad)
        assert after["finish"] == "length" and after["embeds"] == ref["embeds"]

        # Damaged after the scheduler verified it (img-2 was loaded above), the
        # last resort: the worker's zero stand-in keeps the step alive (as wide
        # as the entry: 384 for Qwen3-VL, where the LM's 128 made the model's
        # split raise) and the request fails, one step late (vLLM learns of a
        # failed load after that step's tokens); the engine lives.
        C.reset_encoder_cache()
        damage(store, model_dir, name, "img-2")
        bad, after = C.generate(metadata_only(name, "img-2"), pixels(name, 5, "own-5"))
        assert bad["finish"] == "error" and len(bad["tokens"]) < 3, bad
        assert after["finish"] == "length" and after["encoded"] == n

        if "M" in engines:  # vLLM's default multi-process engine
            M = engines["M"]
            missing, loaded, after = M.generate(metadata_only(name, "nobody-stored-this"), metadata_only(name, "img-1"),
                                                pixels(name, 6, "own-6"))
            assert_failed_before_any_token(missing)
            assert loaded["finish"] == after["finish"] == "length"
            assert len(loaded["tokens"]) == len(after["tokens"]) == 3
    finally:
        for eng in engines.values():
            eng.close()
