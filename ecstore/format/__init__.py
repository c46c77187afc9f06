"""The one place entry bytes are interpreted: a stored entry is a safetensors
blob (``codec``) whose header carries the encoder's record (``record``);
``blob_check`` validates a blob without trusting it, ``blob_read`` decodes
and verifies it into a tensor (``split_read`` on two threads for large
entries). Pure functions over bytes and buffers: no I/O of their own, safe
from any thread.
"""
