"""Pure-PyTorch references for the nki-ardiff ops (3D RoPE, attention, KV cache, linear, causal conv3d).

Modules (import functions from them, e.g. ``from reference.rope3d import rope3d``):

* :mod:`reference.rope3d`: ``rope3d``, ``rope_tables``, ``rope_angles``, ``rope_split``.
* :mod:`reference.attention`: ``attention``, ``attention_segments``, ``merge_attention``.
* :mod:`reference.kv_cache`: ``kv_cache_write``, ``kv_cache_slide``.
* :mod:`reference.linear`: ``linear``.
* :mod:`reference.conv3d`: ``conv3d_causal``.

Each function has the same parameter names as the matching op in :mod:`nki_kernels.ops` and is the
ground truth the kernels are tested against. This package depends on torch only (never on
``nki_kernels``), so a reference never shares code with the thing it checks. The package deliberately
re-exports nothing: a function named like its module (``rope3d``, ``attention``) would shadow the module
attribute and break ``import reference.rope3d``.
"""
