"""Whether vLLM holds what an item's encoder needs to run ("inputs at hand").

vLLM's model runner encodes a scheduled item by passing ``feature.data`` (a
``MultiModalKwargsItem``) to the model's ``embed_multimodal``. An EPD
consumer's metadata-only item (``{"image": {"image_grid_thw": ...}}`` plus a
uuid, no pixels) has ``data`` holding only the fields that size its
placeholder: the model then encodes nothing, vLLM's
``sanity_check_mm_encoder_outputs`` raises and the engine stops. So the
question is not whether ``data`` is None but whether it holds a field other
than those metadata fields, with a value: pixel values, audio features,
video pixels, or pre-computed embeddings the model passes through.

Which fields are metadata is the model's own declaration
(``MultiModalDataParser.embedding_fields``, role ``"metadata"``), read the
way vLLM's connectors read it (``PlaceholderMetadataResolver``); vLLM's CPU
connector decides "local input available" by the same rule. A model that
declares none (e.g. BLIP-2, which cannot be sent metadata-only items) counts
any field with a value.

One :class:`EncoderInputs` per scheduler side; the model's parser is looked
up once, at the first item asked about (it builds vLLM's multimodal
processor, about a second). Scheduler thread only.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("ecstore")


class EncoderInputs:
    """Answers :meth:`at_hand` for the items of one model."""

    def __init__(self, model_config: Any) -> None:
        self._model_config = model_config
        self._parser: Any = None
        self._looked_up = False
        self._fields: dict[str, frozenset[str]] = {}

    def metadata_fields(self, modality: str) -> frozenset[str]:
        """The fields of ``modality`` that only size its placeholder."""
        fields = self._fields.get(modality)
        if fields is None:
            parser = self._parser_class()
            try:
                fields = frozenset(parser.placeholder_metadata_fields(modality)) if parser else frozenset()
            except Exception as e:  # an unusual parser: count every field (vLLM's resolver does the same)
                log.warning("ecstore: placeholder metadata fields of %s unknown (%s): every processed "
                            "field counts as encoder input", modality, e)
                fields = frozenset()
            self._fields[modality] = fields
        return fields

    def at_hand(self, feature: Any) -> bool:
        """Whether vLLM can run the encoder for ``feature`` (a
        ``MultiModalFeatureSpec``): its ``data`` holds a field that is not
        placeholder metadata, with a value."""
        data = getattr(feature, "data", None)
        if not data:
            return False
        metadata = self.metadata_fields(feature.modality)
        return any(getattr(elem, "data", None) is not None
                   for key, elem in data.items() if key not in metadata)

    def _parser_class(self) -> Any:
        if not self._looked_up:
            self._looked_up = True
            try:
                from vllm.multimodal import MULTIMODAL_REGISTRY

                info = MULTIMODAL_REGISTRY.create_processor(self._model_config).info
                self._parser = type(info.data_parser)
            except Exception as e:  # not multimodal, or a processor that does not build here
                log.warning("ecstore: could not read the model's multimodal fields (%s): every "
                            "processed field counts as encoder input", e)
        return self._parser
