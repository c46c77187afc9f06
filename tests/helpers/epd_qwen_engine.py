"""A long-lived real vLLM engine of a tiny Qwen model (Qwen2.5-VL, Qwen3-VL, Qwen2-Audio,
the Qwen2.5-Omni thinker) for the EPD tests
(tests/engine/test_epd_qwen_engine.py), driven by JSON lines.

    python epd_qwen_engine.py --name qwen2_5_vl --model DIR --role ec_producer|ec_consumer
                              --extra JSON [--multiprocess]

Single process by default (engine core and worker here: the model is
instrumented); ``--multiprocess``: vLLM's default multi-process engine (the
model lives in another process: no ``embeds``/``encoded``). vLLM's console
output goes to stderr; stdout carries only this protocol: ``{"ready": true}``,
then one answer per command line read from stdin:

    {"op": "generate", "requests": [request, ...]}
        one request per entry, one after the other (greedy, a few tokens); a
        request is a list of parts, one item each, in prompt order; a part is
        {"image": seed, "size": px, "uuid": U} or {"audio": seed, "uuid": U}
        (inputs), or {"metadata": {"modality": M, FIELD: value, ...}, "uuid": U}
        (metadata-only, as an EPD proxy sends it to a consumer, e.g.
        ``{"image": {"image_grid_thw": ...}}``, ``{"audio": {"audio_num_tokens": ...}}``;
        each value becomes a one-item tensor) ->
        {"results": [{"finish": reason, "tokens": [ids], "embeds": [[sum, abs_sum, sha256]],
                      "encoded": items the encoders ran for}, ...]}
        A request that raises (the engine died) answers {"raised": "..."}.
    {"op": "reset_encoder_cache"} -> {"ok": true}   (vLLM forgets what it encoded or loaded)
    {"op": "exit"}
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from engine_child import count_and_record

_EMBEDS: list[Any] = []
_ENCODED = [0]


def _instrument(model: Any) -> bool:
    return count_and_record(model, _ENCODED, _EMBEDS)


def _part(part: dict[str, Any]) -> tuple[str, Any]:
    """(modality, the item's ``multi_modal_data`` value) of one request part."""
    import torch

    from ecstore.testing import tiny_qwen

    if "metadata" in part:
        fields = dict(part["metadata"])
        modality = fields.pop("modality")
        return modality, {k: torch.tensor([v]) for k, v in fields.items()}
    if "audio" in part:
        return "audio", tiny_qwen.audio_item(part["audio"])
    return "image", tiny_qwen.make_image(part["image"], part["size"])


def _prompt(name: str, parts: list[dict[str, Any]]) -> dict[str, Any]:
    from ecstore.testing import tiny_qwen

    items = [_part(p) for p in parts]
    data: dict[str, Any] = {}
    uuids: dict[str, list[str]] = {}
    for (modality, value), part in zip(items, parts):
        data.setdefault(modality, []).append(value)
        uuids.setdefault(modality, []).append(part["uuid"])
    # One item of a modality goes as the item itself (not a list of one).
    data = {m: v[0] if len(v) == 1 else v for m, v in data.items()}
    return {"prompt": tiny_qwen.prompt(name, [m for m, _ in items]), "multi_modal_data": data,
            "multi_modal_uuids": uuids}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--name", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--role", required=True)
    ap.add_argument("--extra", default="{}")
    ap.add_argument("--multiprocess", action="store_true")
    a = ap.parse_args()
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    from ecstore.testing import tiny_inputs, tiny_qwen

    single = not a.multiprocess
    if single:
        tiny_inputs.setup_single_process_env()
    from vllm import LLM, SamplingParams
    from vllm.config import ECTransferConfig

    ec = ECTransferConfig(ec_connector="ECStoreConnector", ec_role=a.role,
                          ec_connector_module_path="ecstore.connector",
                          ec_connector_extra_config=json.loads(a.extra))
    llm = LLM(**tiny_qwen.engine_kwargs(a.name, a.model, single_process=single, enable_prefix_caching=False,
                                        ec_transfer_config=ec))
    if single:
        assert all(llm.apply_model(_instrument))
    params = SamplingParams(**tiny_inputs.greedy_sampling_kwargs(3))
    print(json.dumps({"ready": True}), file=proto)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "exit":
            break
        if cmd["op"] == "reset_encoder_cache":
            llm.llm_engine.reset_encoder_cache()
            print(json.dumps({"ok": True}), file=proto)
            continue
        results = []
        for parts in cmd["requests"]:
            _EMBEDS.clear()
            _ENCODED[0] = 0
            try:
                out = llm.generate(_prompt(a.name, parts), params, use_tqdm=False)
            except Exception as e:  # the engine died: what the test must never see  # noqa: BLE001
                results.append({"raised": f"{type(e).__name__}: {e}"})
                continue
            completion = out[0].outputs[0]
            results.append({"finish": str(completion.finish_reason), "tokens": list(completion.token_ids),
                            "embeds": list(_EMBEDS), "encoded": _ENCODED[0]})
        print(json.dumps({"results": results}), file=proto)
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # an engine that died already  # noqa: BLE001
        pass
    print(json.dumps({"exited": True}), file=proto)


if __name__ == "__main__":
    main()
