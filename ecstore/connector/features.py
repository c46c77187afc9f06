"""Whether vLLM holds what an item's encoder needs to run ("inputs at hand").

:class:`EncoderInputs` says whether an item's ``feature.data`` holds a field
other than the model's declared placeholder metadata (an EPD consumer's
metadata-only item does not, and encoding it would stop the engine); when the
declaration cannot be read it fails closed (:data:`ENCODER_INPUT_FIELDS`).
One per scheduler side; the parser is looked up once, at the first item
(about a second). Scheduler thread only. Why and how:
docs/architecture.md#inputs-at-hand.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("ecstore")

#: Fields that are encoder inputs wherever vLLM's models use them (pixels,
#: audio features, pre-computed embeddings): what counts when a model's
#: placeholder metadata fields are unknown.
ENCODER_INPUT_FIELDS = frozenset({
    "pixel_values", "pixel_values_videos", "video_pixel_values", "image_pixel_values", "patch_pixel_values",
    "pixel_values_flat", "pixel_values_flat_video", "images",
    "input_features", "input_features_padded", "input_audio_features", "audio_features", "input_values",
    "image_embeds", "video_embeds", "audio_embeds", "input_image_embeds", "input_audio_embeds",
})


class EncoderInputs:
    """Answers :meth:`at_hand` for the items of one model."""

    def __init__(self, model_config: Any) -> None:
        self._model_config = model_config
        self._parser: Any = None
        self._looked_up = False
        self._fields: dict[str, frozenset[str] | None] = {}

    def metadata_fields(self, modality: str) -> frozenset[str] | None:
        """The fields of ``modality`` that only size its placeholder; None if
        they cannot be read (docs/architecture.md#inputs-at-hand)."""
        if modality in self._fields:
            return self._fields[modality]
        fields: frozenset[str] | None = None
        parser = self._parser_class()
        if parser is not None:
            try:
                fields = frozenset(parser.placeholder_metadata_fields(modality))
            except Exception as e:  # an unusual parser  # noqa: BLE001
                log.warning("ecstore: placeholder metadata fields of %s unknown (%s): only known encoder "
                            "inputs (pixel values, audio features, embeddings) count", modality, e)
        self._fields[modality] = fields
        return fields

    def at_hand(self, feature: Any) -> bool:
        """Whether vLLM can run the encoder for ``feature`` (a
        ``MultiModalFeatureSpec``): its ``data`` holds a field that is not
        placeholder metadata (if those are unknown: one of
        :data:`ENCODER_INPUT_FIELDS`), with a value."""
        data = getattr(feature, "data", None)
        if not data:
            return False
        metadata = self.metadata_fields(feature.modality)
        if metadata is None:
            return any(getattr(elem, "data", None) is not None
                       for key, elem in data.items() if key in ENCODER_INPUT_FIELDS)
        return any(getattr(elem, "data", None) is not None
                   for key, elem in data.items() if key not in metadata)

    def _parser_class(self) -> Any:
        if not self._looked_up:
            self._looked_up = True
            try:
                from vllm.multimodal import MULTIMODAL_REGISTRY

                info = MULTIMODAL_REGISTRY.create_processor(self._model_config).info
                self._parser = type(info.data_parser)
            except Exception as e:  # not multimodal, or a processor that does not build here  # noqa: BLE001
                log.warning("ecstore: could not read the model's multimodal fields (%s): only known "
                            "encoder inputs (pixel values, audio features, embeddings) count", e)
        return self._parser
