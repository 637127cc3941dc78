"""The attention ops (``attention``, ``attention_segments``, ``attention_block_table``): raw
``torch.library`` ops with their fakes and the public functions, re-exported by :mod:`nki_kernels.ops` (which
documents the backend and validation rules every op follows)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from nki_kernels import op_dispatch as _d
from nki_kernels.block_table_checks import check_table_values
from nki_kernels.op_checks import (
    _check_bool,
    _check_dims,
    _check_index_tensor,
    _check_int,
    _check_same,
    _check_same_shape,
    _check_tensor,
    _check_tokens,
    _int_values,
    _resolve_scale,
    check_segments,
)
from nki_kernels.op_dispatch import (
    BLOCK_TABLE_KERNEL,
    _empty_lse,
    _fresh,
    _op_backend,
    _run_backend,
    _split_out_lse,
)

FP8_MIN_KEYS = 2048
"""Keys (key positions for the block table) the kernels' FP8 option needs: a second full 1,024-key chunk,
i.e. the streamed static pass (nki_kernels/attention_fp8.py)."""


def _check_fp8(fp8: Any, q: torch.Tensor) -> None:
    """``fp8`` is a bool; True needs bf16 inputs (the tensors were checked to share q's dtype)."""
    _check_bool("fp8", fp8)
    if fp8 and q.dtype != torch.bfloat16:
        raise TypeError(f"fp8=True needs bfloat16 q/k/v (the FP8 P.V path), got {q.dtype}")


def _fp8_kwargs(fp8: bool, keys: int, op: str, be: str) -> dict[str, Any]:
    """The kernel entry's ``fp8`` keyword; ValueError where the kernels' FP8 pass cannot run."""
    if not fp8:
        return {}
    if keys < FP8_MIN_KEYS:
        raise ValueError(
            f"{op}: fp8=True on backend {be!r} needs >= {FP8_MIN_KEYS} keys (the kernels' streamed static "
            f"pass: a second full 1,024-key chunk), got {keys}; use fp8=False or backend='reference'"
        )
    return {"fp8": True}


@torch.library.custom_op("nki_ardiff::attention", mutates_args=())
def _attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    return_lse: bool,
    backend: str,
    fp8: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    be = _run_backend(backend)
    if be == "reference":
        from reference.attention import attention as ref_attention

        res: Any = ref_attention(q, k, v, scale=scale, return_lse=return_lse, fp8=fp8)
    else:
        kw = _fp8_kwargs(fp8, int(k.shape[1]), "attention", be)
        res = _d.entry("attention")(q, k, v, scale=scale, return_lse=return_lse, **kw)
    out, lse = _split_out_lse(res, return_lse, q)
    return _fresh(out, q, k, v), _fresh(lse, q, k, v)


@_attention_op.register_fake
def _(q, k, v, scale, return_lse, backend, fp8=False):
    return torch.empty_like(q), _empty_lse(q, return_lse)


def _attention_setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    q, k, v, scale, return_lse, _, fp8 = inputs
    ctx.save_for_backward(q, k, v)
    ctx.scale, ctx.return_lse, ctx.fp8 = scale, return_lse, fp8


def _attention_backward(
    ctx: Any, grad_out: torch.Tensor, grad_lse: torch.Tensor
) -> tuple[torch.Tensor | None, ...]:
    """Gradient of exact softmax attention, whatever backend ran the forward: the reference math
    (fp32 scores) is recomputed under autograd and differentiated (training a small model on CPU)."""
    from reference.attention import attention as ref_attention

    if ctx.fp8:
        raise RuntimeError("ops.attention: fp8=True is forward only (no gradient through e4m3 P.V)")
    q, k, v = ctx.saved_tensors
    with torch.enable_grad():
        qd, kd, vd = (t.detach().requires_grad_(True) for t in (q, k, v))
        out, lse = ref_attention(qd, kd, vd, scale=ctx.scale, return_lse=True)
        outs, grads = [out], [grad_out]
        if ctx.return_lse and grad_lse is not None and grad_lse.numel():
            outs.append(lse)
            grads.append(grad_lse)
        gq, gk, gv = torch.autograd.grad(outs, (qd, kd, vd), grads, allow_unused=True)
    return gq, gk, gv, None, None, None, None


_attention_op.register_autograd(_attention_backward, setup_context=_attention_setup_context)


@torch.library.custom_op("nki_ardiff::attention_segments", mutates_args=())
def _attention_segments_op(
    q: torch.Tensor,
    kv_k: torch.Tensor,
    kv_v: torch.Tensor,
    segments: list[int],
    scale: float,
    return_lse: bool,
    backend: str,
    fp8: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    segs = [(segments[i], segments[i + 1]) for i in range(0, len(segments), 2)]
    be = _run_backend(backend)
    if be == "reference":
        from reference.attention import attention_segments as ref_segments

        res: Any = ref_segments(q, kv_k, kv_v, segs, scale=scale, return_lse=return_lse, fp8=fp8)
    else:
        fn = _d.entry("attention_segments")
        kw = _fp8_kwargs(fp8, sum(n for _, n in segs), "attention_segments", be)
        res = fn(q, kv_k, kv_v, segs, scale=scale, return_lse=return_lse, **kw)
    out, lse = _split_out_lse(res, return_lse, q)
    return _fresh(out, q, kv_k, kv_v), _fresh(lse, q, kv_k, kv_v)


@_attention_segments_op.register_fake
def _(q, kv_k, kv_v, segments, scale, return_lse, backend, fp8=False):
    return torch.empty_like(q), _empty_lse(q, return_lse)


@torch.library.custom_op("nki_ardiff::attention_block_table", mutates_args=())
def _attention_block_table_op(
    q: torch.Tensor,
    k_sources: list[torch.Tensor],
    v_sources: list[torch.Tensor],
    block_table: torch.Tensor,
    q_groups: list[int],
    block_tokens: int,
    scale: float,
    return_lse: bool,
    backend: str,
    fp8: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    table = _int_values("block_table", block_table)
    check_table_values(table, [int(t.shape[1]) for t in k_sources], block_tokens)
    be = _run_backend(backend)
    if be == "reference":
        from reference.attention import attention_block_table as ref_table

        res: Any = ref_table(
            q, k_sources, v_sources, block_table, q_groups, block_tokens, scale=scale, return_lse=return_lse,
            fp8=fp8,
        )  # fmt: skip
    else:
        import importlib

        module, name = BLOCK_TABLE_KERNEL
        fn = getattr(importlib.import_module(f"nki_kernels.{module}"), name, None)
        if fn is None:
            raise NotImplementedError(
                f"attention_block_table: backend={be!r} has no NKI kernel yet (nki_kernels.{module}.{name} "
                "does not exist); use backend='reference' for this op (or the two-pass pipeline, which only "
                "needs attention / attention_segments)"
            )
        kw = _fp8_kwargs(fp8, int(block_table.shape[1]) * block_tokens, "attention_block_table", be)
        res = fn(q, k_sources, v_sources, block_table, q_groups, block_tokens, scale=scale,
                 return_lse=return_lse, **kw)  # fmt: skip
    out, lse = _split_out_lse(res, return_lse, q)
    return _fresh(out, q, *k_sources, *v_sources), _fresh(lse, q, *k_sources, *v_sources)


@_attention_block_table_op.register_fake
def _(q, k_sources, v_sources, block_table, q_groups, block_tokens, scale, return_lse, backend, fp8=False):
    return torch.empty_like(q), _empty_lse(q, return_lse)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    return_lse: bool = False,
    fp8: bool = False,
    backend: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention reading and writing the per-head projection layout (no transposes).

    Args:
        q: ``[B, Lq, H, D]``; k, v: ``[B, Lk, H, D]``. Contiguous, one dtype (bf16 or fp32), same B, H, D;
            ``Lq, Lk >= 1`` (any length, not only multiples of 128).
        scale: softmax scale (finite, > 0), default ``1/sqrt(D)``.
        return_lse: also return the natural log-sum-exp of the scaled scores, ``[B, Lq, H]`` fp32.
        fp8: the FP8 attention option, off by default (docs/kernels/attention_fp8.md;
            reference ``reference.attention_fp8``): P.V in e4m3 with a per-128-query-tile offset and V's
            per-channel scales over the keys. bf16 inputs only (TypeError otherwise); on the kernel backends
            ``Lk >= 2048`` (:data:`FP8_MIN_KEYS`, ValueError otherwise); forward only (backward raises).
        backend: see module docstring.

    Returns:
        ``out`` ``[B, Lq, H, D]`` in q's dtype, or ``(out, lse)`` when ``return_lse``. Statistics in fp32.

    Differentiable in q, k, v on every backend: the backward recomputes the reference's fp32 softmax
    attention under autograd (the demo model trains through the DiT's cross-attention with it).
    """
    _check_tensor("q", q)
    _check_tensor("k", k)
    _check_tensor("v", v)
    _check_same(("q", "k", "v"), (q, k, v))
    _check_dims("k", k, "q", q, {0: "batch B", 2: "heads H", 3: "head_dim D"})
    _check_dims("v", v, "k", k, {0: "batch B", 1: "length Lk", 2: "heads H", 3: "head_dim D"})
    _check_tokens("q", q, "Lq")
    _check_tokens("k", k, "Lk")
    sc = _resolve_scale(scale, q.shape[3])
    _check_bool("return_lse", return_lse)
    _check_fp8(fp8, q)
    be = _op_backend(backend)
    out, lse = _attention_op(q, k, v, sc, return_lse, be, fp8)
    return (out, lse) if return_lse else out


def attention_segments(
    q: torch.Tensor,
    kv_k: torch.Tensor,
    kv_v: torch.Tensor,
    segments: Sequence[tuple[int, int]],
    *,
    scale: float | None = None,
    return_lse: bool = False,
    fp8: bool = False,
    backend: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of q over ordered segments of a KV buffer, read in place (never gathered by the kernel).

    Args:
        q: ``[B, Lq, H, D]``; kv_k, kv_v: KV buffers ``[B, S, H, D]`` (same shape). Contiguous, one dtype
            (bf16 or fp32), same B, H, D.
        segments: ordered, non-overlapping, non-empty ``(start, length)`` token ranges within ``[0, S)``;
            keys/values are their concatenation in the given order (the raw op receives them flattened
            as ``int[] [start0, length0, start1, length1, ...]``).
        scale, return_lse, fp8, backend: as in :func:`attention` (fp8: V's scales over the segments' keys,
            Lk = the segments' total).

    Returns:
        ``out`` ``[B, Lq, H, D]`` in q's dtype, or ``(out, lse)`` with lse ``[B, Lq, H]`` fp32.
    """
    _check_tensor("q", q)
    _check_tensor("kv_k", kv_k)
    _check_tensor("kv_v", kv_v)
    _check_same(("q", "kv_k", "kv_v"), (q, kv_k, kv_v))
    _check_dims("kv_k", kv_k, "q", q, {0: "batch B", 2: "heads H", 3: "head_dim D"})
    _check_dims(
        "kv_v", kv_v, "kv_k", kv_k, {0: "batch B", 1: "buffer length S", 2: "heads H", 3: "head_dim D"}
    )
    _check_tokens("q", q, "Lq")
    segs = check_segments(segments, kv_k.shape[1])
    sc = _resolve_scale(scale, q.shape[3])
    _check_bool("return_lse", return_lse)
    _check_fp8(fp8, q)
    be = _op_backend(backend)
    flat = [x for seg in segs for x in seg]
    out, lse = _attention_segments_op(q, kv_k, kv_v, flat, sc, return_lse, be, fp8)
    return (out, lse) if return_lse else out


def attention_block_table(
    q: torch.Tensor,
    k_sources: Sequence[torch.Tensor],
    v_sources: Sequence[torch.Tensor],
    block_table: torch.Tensor,
    q_groups: Sequence[int],
    block_tokens: int,
    *,
    scale: float | None = None,
    return_lse: bool = False,
    fp8: bool = False,
    backend: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Grouped attention over key blocks read in place from several KV sources through a block table.

    The static-shape attention of the merged forward: every shape is fixed by the arguments' shapes and
    the static ``q_groups`` / ``block_tokens``; which blocks are read is runtime data (``block_table``),
    as a kernel would read it with runtime DMA offsets. No key is gathered by a kernel.

    Args:
        q: ``[B, Lq, H, D]``, split into consecutive query groups of ``q_groups`` tokens (static ints >= 1,
            summing to Lq).
        k_sources, v_sources: equally long non-empty lists; source i is ``[B, S_i, H, D]`` for k and v,
            ``S_i`` a multiple of ``block_tokens``. Contiguous, the dtype of q, same B, H, D.
        block_table: integer tensor ``[G, NB, 2]`` (G = len(q_groups), NB >= 1): entry ``(g, n)`` =
            ``(source, block)``, the n-th key block of group g = tokens ``[block*T, (block+1)*T)`` of
            source ``source``; ``source = -1`` marks an empty entry. Checked when the op runs: sources in
            ``[-1, len(k_sources))``, blocks within their source, no block twice in a group. A group with
            no keys gives zeros (lse ``-inf``).
        block_tokens: T, tokens per block (static int >= 1).
        scale, return_lse: as in :func:`attention`.
        fp8: as in :func:`attention`; V's scales over every token of ``v_sources``; the kernel backends
            need ``NB * block_tokens >= 2048`` key positions (the merged forward's self-attention).
        backend: see module docstring. The kernel backends dispatch to :data:`BLOCK_TABLE_KERNEL` (the NKI
            kernel ``nki_kernels.attention_block_table``; table values are runtime DMA offsets there).

    Returns:
        ``out`` ``[B, Lq, H, D]`` in q's dtype, or ``(out, lse)`` with lse ``[B, Lq, H]`` fp32.
    """
    _check_tensor("q", q)
    for name, srcs in (("k_sources", k_sources), ("v_sources", v_sources)):
        if isinstance(srcs, torch.Tensor) or not isinstance(srcs, Sequence) or len(srcs) == 0:
            raise TypeError(
                f"{name} must be a non-empty list of [B, S, H, D] tensors, got {type(srcs).__name__}"
            )
    if len(k_sources) != len(v_sources):
        raise ValueError(f"k_sources has {len(k_sources)} tensors but v_sources has {len(v_sources)}")
    _check_int("block_tokens", block_tokens)
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    for i, (ks, vs) in enumerate(zip(k_sources, v_sources)):
        _check_tensor(f"k_sources[{i}]", ks)
        _check_tensor(f"v_sources[{i}]", vs)
        _check_same(("q", f"k_sources[{i}]", f"v_sources[{i}]"), (q, ks, vs))
        _check_dims(f"k_sources[{i}]", ks, "q", q, {0: "batch B", 2: "heads H", 3: "head_dim D"})
        _check_same_shape(f"v_sources[{i}]", vs, f"k_sources[{i}]", ks)
        if ks.shape[1] % block_tokens:
            raise ValueError(
                f"k_sources[{i}] length S={ks.shape[1]} must be a multiple of block_tokens={block_tokens}"
            )
    if isinstance(q_groups, (str, bytes)) or not isinstance(q_groups, Sequence) or len(q_groups) == 0:
        raise ValueError(f"q_groups must be a non-empty sequence of ints, got {q_groups!r}")
    for i, n in enumerate(q_groups):
        _check_int(f"q_groups[{i}]", n)
        if n < 1:
            raise ValueError(f"q_groups[{i}] must be >= 1, got {n}")
    if sum(int(n) for n in q_groups) != q.shape[1]:
        raise ValueError(f"q_groups {list(q_groups)} sum to {sum(q_groups)} but q has Lq={q.shape[1]} tokens")
    _check_index_tensor("block_table", block_table, rank=3)
    if block_table.shape[0] != len(q_groups) or block_table.shape[2] != 2 or block_table.shape[1] < 1:
        raise ValueError(
            f"block_table must be [G, NB, 2] with G = len(q_groups) = {len(q_groups)} and NB >= 1, got "
            f"{tuple(block_table.shape)}"
        )
    sc = _resolve_scale(scale, q.shape[3])
    _check_bool("return_lse", return_lse)
    _check_fp8(fp8, q)
    be = _op_backend(backend)
    out, lse = _attention_block_table_op(
        q, list(k_sources), list(v_sources), block_table, [int(n) for n in q_groups], int(block_tokens),
        sc, return_lse, be, fp8,
    )  # fmt: skip
    return (out, lse) if return_lse else out
