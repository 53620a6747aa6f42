"""CacheBlend: reuse the KV of segments (documents) that are not a prefix of the prompt.

    from kvtier.blend import BlendedModel

    blended = BlendedModel(model, store)                   # store: TieredStore or KvtierClient
    result = blended.prefill([system, doc_a, doc_b, question])
    next_token = int(result.logits.argmax())

See docs/blend.md. Modules: ``segments`` (segment namespace and KV in the store), ``rope``
(re-rotation of cached keys), ``forward`` (the blended forward loop), ``model`` (``BlendedModel``).
The task, the tiny trained model that quality is measured with, and its evaluation are harness:
``kvtier_testing.blend``.
"""

from kvtier.blend.model import BlendConfig, BlendedModel, BlendResult
from kvtier.blend.segments import SEGMENT_GROUP, SegmentStore, segment_namespace, split_segments

__all__ = [
    "SEGMENT_GROUP",
    "BlendConfig",
    "BlendResult",
    "BlendedModel",
    "SegmentStore",
    "segment_namespace",
    "split_segments",
]
