"""The encoder identity of a vLLM engine, and vLLM's per-process item names.

:func:`encoder_identity` gathers every ``VllmConfig`` setting of vLLM 0.32
that changes what the encoder produces for a given item (the list and the
reason for each is in :data:`ENCODER_SETTINGS` and docs/correctness.md; those
that change only its rounding, :data:`ROUNDING_ONLY_SETTINGS`, are left out),
plus a fingerprint of the weights, into an
:class:`~ecstore.identity.EncoderIdentity`. The scheduler process and every
worker compute it from the same config and files, so they agree.

:func:`per_process_naming` / :func:`is_per_process` detect the identifiers
vLLM makes up per process (``renderer<rank>-mm-<n>-<modality>-<i>``) instead
of hashing the item: those are never stored or looked up.
"""

from __future__ import annotations

import hashlib
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ecstore.identity import EncoderIdentity, fingerprint_weights

log = logging.getLogger("ecstore")


@dataclass(frozen=True)
class EncoderSetting:
    """One ``VllmConfig`` attribute path that changes encoder output."""

    path: str  # e.g. "model_config.multimodal_config.mm_processor_kwargs"
    why: str


#: Every setting of vLLM 0.32's VllmConfig found to change the encoder output
#: of an item whose identifier stays the same (docs/correctness.md).
ENCODER_SETTINGS: tuple[EncoderSetting, ...] = (
    EncoderSetting("model_config.revision", "another revision of the checkpoint"),
    EncoderSetting("model_config.code_revision", "another revision of remote model code"),
    EncoderSetting("model_config.trust_remote_code", "the model class may come from the checkpoint's code"),
    EncoderSetting("model_config.model_impl", "vLLM's or the Transformers implementation of the model"),
    EncoderSetting("model_config.quantization", "quantized vision tower / projector weights"),
    EncoderSetting("model_config.hf_config", "vision/audio sub-configs, projector, query tokens, "
                   "hf_overrides (the whole config except the text model's sub-config)"),
    EncoderSetting("model_config.hf_text_config.hidden_size", "projector output width"),
    EncoderSetting("model_config.multimodal_config.mm_processor_kwargs",
                   "server-level processor settings (e.g. do_normalize, size, num_crops, "
                   "and mm_processor_device folded into them)"),
    EncoderSetting("model_config.multimodal_config.media_io_kwargs", "media decoding (e.g. video num_frames)"),
    EncoderSetting("model_config.multimodal_config.mm_hasher_algorithm", "how items are hashed into identifiers"),
    EncoderSetting("model_config.multimodal_config.mm_encoder_attn_dtype", "fp8 encoder attention"),
    EncoderSetting("model_config.multimodal_config.mm_encoder_fp8_scale_path",
                   "static fp8 scales (the file's content is hashed too)"),
    EncoderSetting("model_config.multimodal_config.video_pruning_rate", "video token pruning"),
    EncoderSetting("model_config.multimodal_config.video_pruning_method", "video token pruning algorithm"),
    EncoderSetting("load_config.load_format", "dummy weights, or another loader"),
    EncoderSetting("lora_config.enable_tower_connector_lora", "LoRA applied to the vision tower/connector"),
    EncoderSetting("lora_config.default_mm_loras", "LoRA adapters applied per modality by default"),
)

#: Settings that change only the rounding of the encoder output, not what it
#: means: the same function of the same item computed another way (like the
#: device, compilation or kernel versions, which no identity covers either).
#: Left out of the identity, so that an encoder instance started with them
#: (EPD: ``--mm-encoder-tp-mode data`` on E only) shares entries with its PD
#: instance. docs/correctness.md section 5 gives the decision per setting.
ROUNDING_ONLY_SETTINGS: tuple[EncoderSetting, ...] = (
    EncoderSetting("model_config.multimodal_config.mm_encoder_tp_mode",
                   "data-parallel encoder (full weights per rank) vs weights split across ranks: "
                   "the same layers, another reduction order"),
    EncoderSetting("model_config.multimodal_config.mm_device_do_normalize",
                   "the processor's normalisation done on the device before the tower instead of "
                   "on the CPU: the same mean/std, another device's arithmetic"),
    EncoderSetting("model_config.multimodal_config.mm_encoder_attn_backend",
                   "which attention kernel computes the same attention"),
)

#: Files of a local model directory that configure the processor (not in hf_config).
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")
#: hf_config sub-configs that only describe the language model.
_TEXT_SUBCONFIGS = ("text_config", "language_config", "llm_config", "text_model")


def _get(obj: Any, path: str) -> Any:
    for part in path.split("."):
        if obj is None:
            return None
        obj = getattr(obj, part, None)
    return obj


def _hf_config_dict(hf_config: Any) -> Any:
    if hf_config is None:
        return None
    try:
        d = hf_config.to_dict()
    except Exception:  # noqa: BLE001 - not a PretrainedConfig: best effort
        return repr(hf_config)
    for k in (*_TEXT_SUBCONFIGS, "_name_or_path", "transformers_version", "_commit_hash"):
        d.pop(k, None)
    return d


def _file_digest(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def encoder_settings(vllm_config: Any) -> dict[str, Any]:
    """``{setting path: value}`` for :data:`ENCODER_SETTINGS` (plus processor
    files of a local model directory and the fp8 scale file's content)."""
    out: dict[str, Any] = {}
    for s in ENCODER_SETTINGS:
        if s.path == "model_config.hf_config":
            out[s.path] = _hf_config_dict(_get(vllm_config, s.path))
        elif s.path != "model_config.revision":  # revision is a field of the identity itself
            out[s.path] = _get(vllm_config, s.path)
    model_dir = Path(str(_get(vllm_config, "model_config.model") or ""))
    if model_dir.is_dir():
        out["processor_files"] = {name: _file_digest(model_dir / name) for name in PROCESSOR_FILES
                                  if (model_dir / name).is_file()}
    scale = _get(vllm_config, "model_config.multimodal_config.mm_encoder_fp8_scale_path")
    if scale:
        out["mm_encoder_fp8_scale_file"] = _file_digest(Path(str(scale)))
    if _get(vllm_config, "load_config.load_format") == "dummy":
        out["model_config.seed"] = _get(vllm_config, "model_config.seed")
    return out


def encoder_identity(vllm_config: Any, dtype_name: str, pinned: str | None) -> EncoderIdentity:
    """The identity entries of this engine are written and read under.

    ``pinned`` (the ``namespace`` config key) replaces the weights
    fingerprint and the revision: the operator vouches for the weights. The
    settings still count. Never raises; a fingerprint that could not read the
    weights is logged (once per process and reason) as a warning.
    """
    mc = vllm_config.model_config
    load_format = str(_get(vllm_config, "load_config.load_format") or "auto")
    weights = fingerprint_weights(str(mc.model), revision=getattr(mc, "revision", None),
                                  load_format=load_format, model_weights=str(getattr(mc, "model_weights", "") or ""),
                                  pinned=pinned)
    if weights.method == "config-only":
        _warn_once(f"ecstore: encoder identity without a weights fingerprint ({weights.reason}): "
                   f"entries are keyed by model string, revision and settings only. If weights can "
                   f"change under the same model string and revision, set the ecstore key "
                   f"'namespace' (ec_namespace / LMCACHE_EC_NAMESPACE) to a value you change with them.")
    revision = None if pinned else getattr(mc, "revision", None)
    return EncoderIdentity(str(mc.model), dtype_name, revision, weights, encoder_settings(vllm_config))


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning(message)


# --------------------------------------------------------------------------- per-process names
#: ``renderer<api rank>-mm-<counter>-<modality>-<index>`` (vllm/renderers/base.py), possibly
#: behind a tower-LoRA prefix.
PER_PROCESS_ID = re.compile(r"renderer\d+-mm-\d+-[A-Za-z0-9_]+-\d+$")


def is_per_process(identifier: str) -> bool:
    """True for an identifier vLLM made up in this process (a counter, not content)."""
    return PER_PROCESS_ID.search(identifier) is not None


def per_process_naming(vllm_config: Any) -> bool:
    """Whether vLLM names items by a per-process counter instead of a content
    hash: ``mm_processor_cache_gb == 0`` and prefix caching off (an
    encoder-only ``ec_producer`` turns prefix caching off itself). Items with
    a client ``multi_modal_uuids`` entry keep the uuid."""
    mm = _get(vllm_config, "model_config.multimodal_config")
    if mm is None:
        return False
    return (getattr(mm, "mm_processor_cache_gb", None) == 0
            and not _get(vllm_config, "cache_config.enable_prefix_caching"))


PER_PROCESS_WARNING = (
    "ecstore: vLLM names multimodal items by a per-process counter here "
    "('renderer<rank>-mm-<n>-<modality>-<i>', not a content hash) because "
    "mm_processor_cache_gb=0 and prefix caching is off{producer}. Such identifiers mean "
    "another item after a restart or in another process, so ecstore neither stores nor "
    "loads them: without client multi_modal_uuids nothing is cached. Fix: set "
    "--mm-processor-cache-gb to a value > 0 (e.g. 4, vLLM's default) or enable prefix caching.")


def per_process_warning(vllm_config: Any) -> str:
    producer = ""
    if _get(vllm_config, "ec_transfer_config.ec_role") == "ec_producer":
        producer = " (an encoder-only ec_producer turns prefix caching off by itself)"
    return PER_PROCESS_WARNING.format(producer=producer)


# --------------------------------------------------------------------------- client uuids
#: vLLM 0.32's content hashes: the hex digest of blake3 / sha256 (64 digits) or
#: sha512 (128), behind an optional tower-LoRA prefix "<lora name>:".
_CONTENT_HASH = re.compile(r"(?:^|:)(?:[0-9a-f]{64}|[0-9a-f]{128})$")


def is_content_hash(identifier: str) -> bool:
    """True if ``identifier`` is shaped like vLLM's content hash. False means
    it certainly is not one (a client uuid or a per-process name); True does
    not prove it is one: a client may send any string, a hash-shaped one
    included, and vLLM hashes a uuid together with per-request processor
    kwargs into a hash-shaped identifier. vLLM 0.32 passes no flag that would
    tell (``MultiModalFeatureSpec`` holds only the identifier)."""
    return _CONTENT_HASH.search(identifier) is not None


#: The digits of a content hash (``_CONTENT_HASH``).
_HEX_DIGITS = "0123456789abcdef"


def kept_out(identifier: str, share_client_uuids: bool) -> str | None:
    """Why ``identifier`` must neither be stored nor looked up, or None.

    A bare 64-digit hash (how vLLM names nearly every item) is answered by
    two string methods, not the two pattern searches below (it holds no
    ``renderer``, and is a content hash): the same answer, fewer steps on
    every save and lookup."""
    if len(identifier) == 64 and not identifier.strip(_HEX_DIGITS):
        return None
    if is_per_process(identifier):
        return "per-process"
    if not share_client_uuids and not is_content_hash(identifier):
        return "client-uuid"
    return None


CLIENT_UUID_WARNING = (
    "ecstore: multimodal item {identifier!r} is named by the client (multi_modal_uuids), not by "
    "its content: ecstore neither stores nor loads such items, since any client could send another "
    "image under the same uuid. Set the ecstore key share_client_uuids: true (ec_share_client_uuids / "
    "LMCACHE_EC_SHARE_CLIENT_UUIDS) if every client of the store is trusted.")
