"""Torch ops for nki-ardiff: input validation and backend dispatch (namespace ``nki_ardiff``).

Every op is registered with :func:`torch.library.custom_op` and has a fake (meta) implementation, so it
traces under ``torch.compile(fullgraph=True)`` and ``torch.export``. Model, pipeline and sharding code call
only the public functions of this module, so one switch reaches every call:

``backend``
    ``"reference"`` (pure PyTorch, :mod:`reference`), ``"emulator"`` (the NKI kernels run on the bundled
    NKI 0.6 emulator) or ``"neuron"`` (the same kernels through the real ``nki`` package; raises unless it
    is importable). ``None`` means: the environment variable ``NKI_ARDIFF_BACKEND`` read at *call* time
    (inside the op when it runs, so compiled graphs honour it too), else ``"reference"``. Anything else,
    including an unknown value of the variable, raises ``ValueError`` naming ``backend``. The emulator and
    neuron backends call the same kernel entry points (``nki_kernels.<op>.<op>_emulated``), which run on
    whatever :mod:`nki_kernels._nki` resolves.

Common rules (checked before dispatch, on every backend, so code validated on the reference backend runs
unchanged on the kernels):

* Activations and caches are ``[B, L, H, D]`` (tokens along dim 1, heads along dim 2), **contiguous**
  (the kernels address HBM as row-major ``[B, L, H, D]``; call ``.contiguous()`` on views), dtype
  ``torch.bfloat16`` or ``torch.float32``, all tensors of one call on the same device and of the same dtype.
* A wrong type or dtype raises ``TypeError``; a wrong shape or value raises ``ValueError``; both name the
  argument and the rule. A kernel backend that cannot honour a valid argument raises
  ``NotImplementedError``; there is never a silent fallback to another backend.

Raw ops (``torch.ops.nki_ardiff.*``) take only schema-friendly arguments: ``segments`` is passed as a flat
``int[]`` ``[start0, length0, start1, length1, ...]``, the scale is always resolved to a float, and the
attention ops always return ``(out, lse)`` where ``lse`` is an empty fp32 tensor when ``return_lse`` is
false. Use the public functions below rather than the raw ops.

Limits (every op; each checked on entry, with the error it raises):

* inference only, except ``attention``: :func:`attention` has a backward (the exact softmax-attention
  gradient, recomputed from the fp32 reference math whatever backend ran the forward); ``backward()``
  through any other functional op raises ``RuntimeError`` naming it ("Trying to backward through
  nki_ardiff.<op>.default but no autograd formula was registered"); the in-place KV-cache ops raise
  ``RuntimeError`` on entry, naming the op and the argument, when grad mode is on and a tensor requires grad;
* tensors contiguous in the documented layout (``ValueError`` "... must be contiguous ...; call
  .contiguous()", never a silent copy); dtypes ``torch.bfloat16`` / ``torch.float32`` (``TypeError``
  naming the tensor and its dtype);
* head_dim: even for the RoPE ops (``ValueError``), at most 128 on the kernel backends (D lives on the 128
  partitions: ``ValueError`` "head_dim D=... must be <= 128"; the reference backend takes any D);
  ``linear``: ``K <= 18,432`` bf16 / ``9,216`` fp32, ``linear_fp8``: ``K <= 32,128`` / ``22,912``
  (``ValueError``); ``adaln_norm_modulate`` /
  ``gate_residual`` / ``rms_norm``: ``C <= 4,608`` bf16 / ``2,560`` fp32 features (``ValueError``;
  ``gelu_tanh``: any ``C``; ``gate_residual_adaln``: ``C <= 1,536``, fp32 x, bf16 y); ``conv3d_causal``:
  kernel extents 1 or 3 and weights that fit SBUF (``ValueError`` naming the limit);
* a backend that cannot run an op (``neuron`` without the Neuron SDK's ``nki``) raises ``RuntimeError`` /
  ``NotImplementedError`` naming the backend; never a silent fallback to another backend.

Where things live: this module re-exports the public API; the ops are defined per family in
:mod:`nki_kernels.ops_rope`, :mod:`nki_kernels.ops_attention`, :mod:`nki_kernels.ops_kv` and
:mod:`nki_kernels.ops_dense` (linear, causal conv3d), :mod:`nki_kernels.ops_linear_fp8` (FP8 linear)
and :mod:`nki_kernels.ops_elementwise` (adaLN norm + modulation, gated residual, RMSNorm, GELU-tanh, gated
residual + adaLN), each holding its raw ops, fakes and public functions;
the argument rules shared by several ops are in :mod:`nki_kernels.op_checks` and backend resolution, the
kernel entry point of every op (written once) and the checks of kernel results in
:mod:`nki_kernels.op_dispatch`.
"""

from __future__ import annotations

from nki_kernels.op_checks import TABLE_DTYPES, check_segments
from nki_kernels.op_dispatch import (
    BACKEND_ENV,
    BACKENDS,
    BLOCK_TABLE_KERNEL,
    DEFAULT_BACKEND,
    has_kernel,
    resolve_backend,
)
from nki_kernels.ops_attention import attention, attention_block_table, attention_segments
from nki_kernels.ops_dense import LINEAR_MAX_K, conv3d_causal, conv_weight_taps, linear
from nki_kernels.ops_elementwise import (
    ELEMENTWISE_MAX_C,
    FUSED_MAX_C,
    adaln_norm_modulate,
    gate_residual,
    gate_residual_adaln,
    gelu_tanh,
    rms_norm,
)
from nki_kernels.ops_kv import kv_cache_slide, kv_cache_write, kv_cache_write_at
from nki_kernels.ops_linear_fp8 import LINEAR_FP8_MAX_K, linear_fp8, quantize_weight_fp8
from nki_kernels.ops_rope import (
    rope3d,
    rope3d_positions,
    rope3d_positions_one,
    rope3d_tables,
    rope3d_tables_one,
    rope_tables,
)

__all__ = [
    "BACKENDS",
    "BACKEND_ENV",
    "BLOCK_TABLE_KERNEL",
    "DEFAULT_BACKEND",
    "ELEMENTWISE_MAX_C",
    "FUSED_MAX_C",
    "LINEAR_FP8_MAX_K",
    "LINEAR_MAX_K",
    "TABLE_DTYPES",
    "adaln_norm_modulate",
    "attention",
    "attention_block_table",
    "attention_segments",
    "check_segments",
    "conv3d_causal",
    "conv_weight_taps",
    "gate_residual",
    "gate_residual_adaln",
    "gelu_tanh",
    "has_kernel",
    "kv_cache_slide",
    "kv_cache_write",
    "kv_cache_write_at",
    "linear",
    "linear_fp8",
    "resolve_backend",
    "rms_norm",
    "rope3d",
    "rope3d_positions",
    "rope3d_positions_one",
    "rope3d_tables",
    "rope3d_tables_one",
    "quantize_weight_fp8",
    "rope_tables",
]
