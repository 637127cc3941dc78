"""Pure-PyTorch references for the nki-ardiff ops (3D RoPE, attention, rolling KV cache).

Each function has the same parameter names as the matching op in :mod:`nki_kernels.ops` and is the
ground truth the kernels are tested against. This package depends on torch only (never on
``nki_kernels``), so a reference never shares code with the thing it checks.
"""

from reference.attention import attention, attention_segments, gather_segments, merge_attention
from reference.kv_cache import kv_cache_slide, kv_cache_write
from reference.rope3d import rope3d, rope_angles, rope_split, rope_tables

__all__ = [
    "attention",
    "attention_segments",
    "gather_segments",
    "kv_cache_slide",
    "kv_cache_write",
    "merge_attention",
    "rope3d",
    "rope_angles",
    "rope_split",
    "rope_tables",
]
