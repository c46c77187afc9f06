"""The tiny BLIP-2's size spec, tokens and chat template, and the hash of a build.

Data and cheap functions only (no transformers/torch import): a build whose
marker holds the same :func:`spec_hash` is reused. See
:mod:`ecstore.testing.tiny_model` for the whole picture.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

# Bump when the build recipe changes in a way that changes the output files.
BUILDER_VERSION = 3
MARKER_NAME = ".tiny_model.json"

PAD_TOKEN = "<pad>"
EOS_TOKEN = "</s>"
UNK_TOKEN = "<unk>"
IMAGE_TOKEN = "<image>"
SPECIAL_TOKENS = [PAD_TOKEN, EOS_TOKEN, UNK_TOKEN, IMAGE_TOKEN]  # ids 0..3

NUM_QUERY_TOKENS = 32
TARGET_VOCAB = 512

# Light: ~0.8 M parameters, ~3 MB, encoder a few ms per image.
LIGHT_SPEC: dict[str, Any] = {
    "vision": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": 224,
        "patch_size": 14,
    },
    "qformer": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
    },
    "text": {
        "hidden_size": 128,
        "ffn_dim": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 2048,
    },
    "num_query_tokens": NUM_QUERY_TOKENS,
    # Larger than transformers' 0.02 default on purpose: with 0.02 every image yields
    # the same greedy tokens (the image barely moves the logits); with 0.2 different
    # images give different tokens, so tests can tell embeddings apart.
    "initializer_range": 0.2,
}

# Heavy: bigger vision tower so the encoder costs 0.2-0.4 s per image on these CPUs
# (enough to see a cache pay off); the LM and the encoder output shape are unchanged.
HEAVY_SPEC: dict[str, Any] = {
    **LIGHT_SPEC,
    "vision": {
        "hidden_size": 384,
        "intermediate_size": 1536,
        "num_hidden_layers": 6,
        "num_attention_heads": 6,
        "image_size": 448,
        "patch_size": 14,
    },
}

_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}"
    "{%- set text = message['content'] -%}"
    "{%- else -%}"
    "{%- set text = namespace(v='') -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}"
    "{%- set text.v = text.v + part['text'] -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- set text = text.v -%}"
    "{%- endif -%}"
    "{%- if message['role'] == 'user' -%}"
    "{{ 'Question: ' + text + ' ' }}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{ 'Answer: ' + text + ' ' }}"
    "{%- else -%}"
    "{{ text + ' ' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'Answer:' }}{%- endif -%}"
)

# Fixed training text for the BPE tokenizer: deterministic, no download.
_WORDS = (
    "the a an of and to in is it that this what which who where when how why image "
    "picture photo shows contains color red green blue yellow black white gray orange "
    "purple pink brown square circle line stripe pattern block grid top bottom left "
    "right center middle corner background foreground object person dog cat car tree "
    "house sky water road light dark bright small large big little many few one two "
    "three four five six seven eight nine ten question answer describe content there "
    "are with on at for from by about over under near next see look scene some"
).split()


def model_spec(heavy: bool = False) -> dict[str, Any]:
    """The size spec used for a build (a deep copy; changing it changes nothing)."""
    return json.loads(json.dumps(HEAVY_SPEC if heavy else LIGHT_SPEC))


def _dist_version(name: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "?"


def spec_hash(*, heavy: bool = False, seed: int = 0) -> str:
    """Hash of everything that determines the output files (stored in the marker)."""
    payload = {
        "builder": BUILDER_VERSION,
        "spec": model_spec(heavy),
        "seed": int(seed),
        # Cheap (no import): a cache hit must not pay for importing transformers.
        "transformers": _dist_version("transformers"),
        "tokenizers": _dist_version("tokenizers"),
        "torch": _dist_version("torch"),
    }
    blob = json.dumps(payload, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]
