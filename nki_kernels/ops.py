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
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from nki_kernels.ops_dense import LINEAR_MAX_K, conv3d_causal, conv_weight_taps, linear

BACKENDS: tuple[str, ...] = ("reference", "emulator", "neuron")
"""Valid values of ``backend``."""

BACKEND_ENV = "NKI_ARDIFF_BACKEND"
"""Environment variable read at call time when ``backend=None``."""

DEFAULT_BACKEND = "reference"

_DTYPES = (torch.bfloat16, torch.float32)

_IntLike = (int, torch.SymInt)


# --------------------------------------------------------------------------------------------------
# backend resolution


def resolve_backend(backend: str | None = None) -> str:
    """Return the backend a call uses: ``backend`` if given, else ``$NKI_ARDIFF_BACKEND``, else reference.

    Raises ``ValueError`` for an unknown name and ``RuntimeError`` for ``"neuron"`` when the real ``nki``
    package is not importable.
    """
    if backend is None:
        env = os.environ.get(BACKEND_ENV, "").strip().lower()
        if env and env not in BACKENDS:
            raise ValueError(f"backend: environment variable {BACKEND_ENV}={env!r} is not one of {BACKENDS}")
        backend = env or DEFAULT_BACKEND
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    if backend == "neuron":
        _require_neuron()
    return backend


_AUTO = ""
"""Backend string the raw ops receive for ``backend=None``: resolved from the environment when the op runs,
so a compiled graph still honours ``NKI_ARDIFF_BACKEND`` at call time (dynamo would otherwise bake the
value read while tracing into the graph)."""


def _op_backend(backend: str | None) -> str:
    """Validate an explicit backend now; defer ``None`` to run time (see ``_AUTO``)."""
    return _AUTO if backend is None else resolve_backend(backend)


def _run_backend(backend: str) -> str:
    """The backend a raw op executes with (called inside the op, i.e. at run time, never traced)."""
    return resolve_backend(None if backend == _AUTO else backend)


def _require_neuron() -> None:
    import importlib.util

    from nki_kernels import _nki

    # without an installed `nki` there is nothing to resolve (and no need to load the emulator)
    name = (
        _nki.backend_name() if importlib.util.find_spec("nki") is not None else "no `nki` package installed"
    )
    if name != "nki":
        raise RuntimeError(
            "backend='neuron' needs the real NKI package (`import nki` must succeed and "
            f"{BACKEND_ENV} must not be 'emulator'); the NKI shim resolved to {name!r}. "
            "Use backend='emulator' to run the kernels on CPU or backend='reference' for PyTorch."
        )


# --------------------------------------------------------------------------------------------------
# validation helpers


def _check_tensor(name: str, t: Any, rank: int = 4) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != rank:
        raise ValueError(f"{name} must have rank {rank} ([B, L, H, D]), got shape {tuple(t.shape)}")
    if t.dtype not in _DTYPES:
        raise TypeError(f"{name} must be torch.bfloat16 or torch.float32, got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(
            f"{name} must be contiguous [B, L, H, D] (the kernels address it row-major); call .contiguous()"
        )


def _check_same(names: Sequence[str], tensors: Sequence[torch.Tensor]) -> None:
    first, t0 = names[0], tensors[0]
    for name, t in zip(names[1:], tensors[1:]):
        if t.dtype != t0.dtype:
            raise TypeError(f"{name} dtype {t.dtype} must match {first} dtype {t0.dtype}")
        if t.device != t0.device:
            raise ValueError(f"{name} is on {t.device} but {first} is on {t0.device}")


def _check_dims(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor, dims: dict[int, str]) -> None:
    for d, label in dims.items():
        if t.shape[d] != ref.shape[d]:
            raise ValueError(
                f"{name} {label} ({name}.shape[{d}]={t.shape[d]}) must match {ref_name} "
                f"({ref_name}.shape[{d}]={ref.shape[d]}); shapes {tuple(t.shape)} vs {tuple(ref.shape)}"
            )


def _check_int(name: str, x: Any) -> None:
    if isinstance(x, bool) or not isinstance(x, _IntLike):
        raise TypeError(f"{name} must be an int, got {type(x).__name__}")


# --------------------------------------------------------------------------------------------------
# dispatch helpers


def _kernel(module: str, fn: str) -> Callable[..., Any]:
    import importlib

    mod = importlib.import_module(f"nki_kernels.{module}")
    return getattr(mod, fn)


def _fresh(out: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
    """custom_op outputs may not alias inputs: copy if a kernel returned an input's storage."""
    for t in inputs:
        if out.untyped_storage().data_ptr() == t.untyped_storage().data_ptr():
            return out.clone()
    return out.contiguous()


def _split_out_lse(res: Any, return_lse: bool, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(res, tuple):
        out, lse = res
    else:
        out, lse = res, None
    if tuple(out.shape) != tuple(q.shape) or out.dtype != q.dtype:
        raise RuntimeError(
            f"kernel returned out {tuple(out.shape)} {out.dtype}; expected q's {tuple(q.shape)} {q.dtype}"
        )
    if not return_lse:
        lse = q.new_empty((0,), dtype=torch.float32)
    elif lse is None:
        raise RuntimeError("kernel was asked for return_lse=True but returned no lse")
    elif tuple(lse.shape) != tuple(q.shape[:3]):
        raise RuntimeError(
            f"kernel returned lse {tuple(lse.shape)}; expected [B, Lq, H] = {tuple(q.shape[:3])}"
        )
    return out, lse.float()


def _empty_lse(q: torch.Tensor, return_lse: bool) -> torch.Tensor:
    if return_lse:
        return q.new_empty((q.shape[0], q.shape[1], q.shape[2]), dtype=torch.float32)
    return q.new_empty((0,), dtype=torch.float32)


def _rope_outputs(
    qo: torch.Tensor, ko: torch.Tensor, q: torch.Tensor, k: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Check a rope kernel's outputs against the op's contract (q's shape and dtype); return fresh tensors."""
    for name, t in (("q", qo), ("k", ko)):
        if tuple(t.shape) != tuple(q.shape) or t.dtype != q.dtype:
            raise RuntimeError(
                f"kernel returned {name} {tuple(t.shape)} {t.dtype}; expected {tuple(q.shape)} {q.dtype}"
            )
    return _fresh(qo, q, k), _fresh(ko, q, k)


def _copy_back(res: Any, cache_k: torch.Tensor, cache_v: torch.Tensor) -> None:
    """Kernels may mutate the caches in place (return None) or return new ``(cache_k, cache_v)``."""
    if res is None:
        return
    new_k, new_v = res
    if new_k is not cache_k:
        cache_k.copy_(new_k)
    if new_v is not cache_v:
        cache_v.copy_(new_v)


# --------------------------------------------------------------------------------------------------
# raw ops


@torch.library.custom_op("nki_ardiff::rope3d", mutates_args=())
def _rope3d_op(
    q: torch.Tensor,
    k: torch.Tensor,
    grid: list[int],
    start_frame: int,
    frame_positions: list[int] | None,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    fp = list(frame_positions) if frame_positions is not None else None
    if _run_backend(backend) == "reference":
        from reference.rope3d import rope3d as ref_rope3d

        return ref_rope3d(q, k, tuple(grid), start_frame, fp)
    fn = _kernel("rope3d", "rope3d_emulated")
    qo, ko = fn(q, k, tuple(grid), start_frame=start_frame, frame_positions=fp)
    return _rope_outputs(qo, ko, q, k)


@_rope3d_op.register_fake
def _(q, k, grid, start_frame, frame_positions, backend):
    return torch.empty_like(q), torch.empty_like(k)


@torch.library.custom_op("nki_ardiff::attention", mutates_args=())
def _attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, return_lse: bool, backend: str
) -> tuple[torch.Tensor, torch.Tensor]:
    if _run_backend(backend) == "reference":
        from reference.attention import attention as ref_attention

        res: Any = ref_attention(q, k, v, scale=scale, return_lse=return_lse)
    else:
        res = _kernel("attention", "attention_emulated")(q, k, v, scale=scale, return_lse=return_lse)
    out, lse = _split_out_lse(res, return_lse, q)
    return _fresh(out, q, k, v), _fresh(lse, q, k, v)


@_attention_op.register_fake
def _(q, k, v, scale, return_lse, backend):
    return torch.empty_like(q), _empty_lse(q, return_lse)


@torch.library.custom_op("nki_ardiff::attention_segments", mutates_args=())
def _attention_segments_op(
    q: torch.Tensor,
    kv_k: torch.Tensor,
    kv_v: torch.Tensor,
    segments: list[int],
    scale: float,
    return_lse: bool,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    segs = [(segments[i], segments[i + 1]) for i in range(0, len(segments), 2)]
    if _run_backend(backend) == "reference":
        from reference.attention import attention_segments as ref_segments

        res: Any = ref_segments(q, kv_k, kv_v, segs, scale=scale, return_lse=return_lse)
    else:
        fn = _kernel("attention", "attention_segments_emulated")
        res = fn(q, kv_k, kv_v, segs, scale=scale, return_lse=return_lse)
    out, lse = _split_out_lse(res, return_lse, q)
    return _fresh(out, q, kv_k, kv_v), _fresh(lse, q, kv_k, kv_v)


@_attention_segments_op.register_fake
def _(q, kv_k, kv_v, segments, scale, return_lse, backend):
    return torch.empty_like(q), _empty_lse(q, return_lse)


@torch.library.custom_op("nki_ardiff::kv_cache_write", mutates_args=("cache_k", "cache_v"))
def _kv_cache_write_op(
    cache_k: torch.Tensor, cache_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot: int, backend: str
) -> None:
    if _run_backend(backend) == "reference":
        from reference.kv_cache import kv_cache_write as ref_write

        ref_write(cache_k, cache_v, k, v, slot)
        return
    res = _kernel("kv_cache", "kv_cache_write_emulated")(cache_k, cache_v, k, v, slot)
    _copy_back(res, cache_k, cache_v)


@_kv_cache_write_op.register_fake
def _(cache_k, cache_v, k, v, slot, backend):
    return None


@torch.library.custom_op("nki_ardiff::kv_cache_slide", mutates_args=("cache_k", "cache_v"))
def _kv_cache_slide_op(
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sink_tokens: int,
    backend: str,
) -> None:
    if _run_backend(backend) == "reference":
        from reference.kv_cache import kv_cache_slide as ref_slide

        ref_slide(cache_k, cache_v, k, v, sink_tokens)
        return
    res = _kernel("kv_cache", "kv_cache_slide_emulated")(cache_k, cache_v, k, v, sink_tokens)
    _copy_back(res, cache_k, cache_v)


@_kv_cache_slide_op.register_fake
def _(cache_k, cache_v, k, v, sink_tokens, backend):
    return None


# ---- static-shape variants: runtime indices as tensors (one graph for every window of a stream) ----


def _int_values(name: str, t: torch.Tensor) -> list[Any]:
    """Runtime (eager, inside an op) integer values of an index tensor."""
    return t.tolist()


@torch.library.custom_op("nki_ardiff::rope3d_positions", mutates_args=())
def _rope3d_positions_op(
    q: torch.Tensor, k: torch.Tensor, grid: list[int], frame_positions: torch.Tensor, backend: str
) -> tuple[torch.Tensor, torch.Tensor]:
    fp = [int(x) for x in _int_values("frame_positions", frame_positions)]
    for i, p in enumerate(fp):
        if p < 0:
            raise ValueError(f"frame_positions[{i}] must be >= 0, got {p}")
    if _run_backend(backend) == "reference":
        from reference.rope3d import rope3d as ref_rope3d

        return ref_rope3d(q, k, tuple(grid), 0, fp)
    # the rope kernel already takes per-frame positions as runtime values (host-built cos/sin tables)
    fn = _kernel("rope3d", "rope3d_emulated")
    qo, ko = fn(q, k, tuple(grid), start_frame=0, frame_positions=fp)
    return _rope_outputs(qo, ko, q, k)


@_rope3d_positions_op.register_fake
def _(q, k, grid, frame_positions, backend):
    return torch.empty_like(q), torch.empty_like(k)


@torch.library.custom_op("nki_ardiff::rope_tables", mutates_args=())
def _rope_tables_op(
    frame_positions: torch.Tensor, grid: list[int], head_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    fp = [int(x) for x in _int_values("frame_positions", frame_positions)]
    for i, p in enumerate(fp):
        if p < 0:
            raise ValueError(f"frame_positions[{i}] must be >= 0, got {p}")
    from reference.rope3d import rope_tables as ref_tables

    cos, sin = ref_tables(tuple(grid), head_dim, 0, fp, dtype=dtype)
    return cos.to(frame_positions.device), sin.to(frame_positions.device)


@_rope_tables_op.register_fake
def _(frame_positions, grid, head_dim, dtype):
    n = grid[0] * grid[1] * grid[2]
    shape = (n, head_dim // 2)
    return frame_positions.new_empty(shape, dtype=dtype), frame_positions.new_empty(shape, dtype=dtype)


@torch.library.custom_op("nki_ardiff::rope3d_tables", mutates_args=())
def _rope3d_tables_op(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: str
) -> tuple[torch.Tensor, torch.Tensor]:
    if _run_backend(backend) == "reference":
        from reference.rope3d import rope3d_tables as ref_rope3d_tables

        return ref_rope3d_tables(q, k, cos, sin)
    qo, ko = _kernel("rope3d", "rope3d_tables_emulated")(q, k, cos, sin)
    return _rope_outputs(qo, ko, q, k)


@_rope3d_tables_op.register_fake
def _(q, k, cos, sin, backend):
    return torch.empty_like(q), torch.empty_like(k)


@torch.library.custom_op("nki_ardiff::kv_cache_write_at", mutates_args=("cache_k", "cache_v"))
def _kv_cache_write_at_op(
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot: torch.Tensor,
    backend: str,
) -> None:
    s_val = int(slot.item())
    t, s = k.shape[1], cache_k.shape[1]
    if s_val < 0 or (s_val + 1) * t > s:
        raise ValueError(
            f"slot={s_val} out of range: need 0 <= slot and (slot+1)*T <= S with T={t}, S={s} "
            f"(valid slots 0..{s // t - 1})"
        )
    if _run_backend(backend) == "reference":
        from reference.kv_cache import kv_cache_write as ref_write

        ref_write(cache_k, cache_v, k, v, s_val)
        return
    # the ring-write kernel takes the slot as a runtime scalar (DMA offset), so a tensor slot maps 1:1
    res = _kernel("kv_cache", "kv_cache_write_emulated")(cache_k, cache_v, k, v, s_val)
    _copy_back(res, cache_k, cache_v)


@_kv_cache_write_at_op.register_fake
def _(cache_k, cache_v, k, v, slot, backend):
    return None


BLOCK_TABLE_KERNEL = ("attention_block_table", "attention_block_table_emulated")
"""``(module, function)`` the kernel backends dispatch :func:`attention_block_table` to, with the signature
``fn(q, k_sources, v_sources, block_table, q_groups, block_tokens, scale=, return_lse=)`` returning ``out``
or ``(out, lse)``: :func:`nki_kernels.attention_block_table.attention_block_table_emulated` (the block table
is a runtime kernel input, so one compiled kernel serves every table of a given shape)."""


def _check_table_values(
    table: list[Any], sizes: Sequence[int], block_tokens: int, name: str = "block_table"
) -> None:
    for g, row in enumerate(table):
        seen: set[tuple[int, int]] = set()
        for n, (src, blk) in enumerate(row):
            if src == -1:
                continue
            if not 0 <= src < len(sizes):
                raise ValueError(
                    f"{name}[{g}, {n}] source={src} must be -1 (empty) or in [0, {len(sizes)}) "
                    f"(the number of k_sources)"
                )
            nblk = sizes[src] // block_tokens
            if not 0 <= blk < nblk:
                raise ValueError(
                    f"{name}[{g}, {n}] block={blk} is out of source {src}'s {nblk} blocks of "
                    f"{block_tokens} tokens"
                )
            if (src, blk) in seen:
                raise ValueError(f"{name}[{g}] lists block ({src}, {blk}) twice (keys would count twice)")
            seen.add((src, blk))


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
) -> tuple[torch.Tensor, torch.Tensor]:
    table = _int_values("block_table", block_table)
    _check_table_values(table, [int(t.shape[1]) for t in k_sources], block_tokens)
    be = _run_backend(backend)
    if be == "reference":
        from reference.attention import attention_block_table as ref_table

        res: Any = ref_table(
            q, k_sources, v_sources, block_table, q_groups, block_tokens, scale=scale, return_lse=return_lse
        )
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
        res = fn(q, k_sources, v_sources, block_table, q_groups, block_tokens, scale=scale,
                 return_lse=return_lse)  # fmt: skip
    out, lse = _split_out_lse(res, return_lse, q)
    return _fresh(out, q, *k_sources, *v_sources), _fresh(lse, q, *k_sources, *v_sources)


@_attention_block_table_op.register_fake
def _(q, k_sources, v_sources, block_table, q_groups, block_tokens, scale, return_lse, backend):
    return torch.empty_like(q), _empty_lse(q, return_lse)


# --------------------------------------------------------------------------------------------------
# public API


def rope3d(
    q: torch.Tensor,
    k: torch.Tensor,
    grid: Sequence[int],
    start_frame: int = 0,
    *,
    frame_positions: Sequence[int] | torch.Tensor | None = None,
    max_positions: int | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Wan2.1 3D RoPE of q and k in one launch (returns new tensors; see :mod:`reference.rope3d`).

    Args:
        q, k: ``[B, L, H, D]`` contiguous, bf16 or fp32, identical shapes and dtypes; D even.
        grid: ``(F, Hp, Wp)``, each >= 1, with ``F*Hp*Wp == L``; tokens in (f, h, w) row-major order.
        start_frame: time position of frame 0 (>= 0); frame f is at ``start_frame + f``.
        frame_positions: optional length-F non-negative integer time positions (e.g. to re-position a
            leading sink segment). Mutually exclusive with a non-zero ``start_frame``. Pass a Python
            list/tuple under ``torch.compile(fullgraph=True)`` (a tensor is converted with ``.tolist()``).
        max_positions: optional declared table size (Wan's original table has 1024): every time, height and
            width position must then be ``< max_positions``.
        backend: see module docstring.

    Pairs are split time/height/width as ``D/2 - 2*(D//6)`` / ``D//6`` / ``D//6`` (22/21/21 at D=128),
    base 10000, interleaved (2j real, 2j+1 imaginary), the same angles for every head. Kernels consume
    precomputed cos/sin tables (:func:`reference.rope3d.rope_tables`).
    """
    _check_tensor("q", q)
    _check_tensor("k", k)
    _check_same(("q", "k"), (q, k))
    if tuple(k.shape) != tuple(q.shape):
        raise ValueError(f"k shape {tuple(k.shape)} must equal q shape {tuple(q.shape)} ([B, L, H, D])")
    d = q.shape[3]
    if d % 2:
        raise ValueError(f"q/k head_dim D={d} must be even (interleaved complex pairs)")
    if isinstance(grid, (str, bytes)) or not isinstance(grid, Sequence) or len(grid) != 3:
        raise ValueError(f"grid must be a sequence (F, Hp, Wp) of 3 ints, got {grid!r}")
    for i, g in enumerate(grid):
        _check_int(f"grid[{i}]", g)
        if g < 1:
            raise ValueError(f"grid[{i}] must be >= 1, got grid={tuple(grid)}")
    f, hp, wp = (int(g) for g in grid)
    if f * hp * wp != q.shape[1]:
        raise ValueError(
            f"grid {tuple(grid)} gives F*Hp*Wp={f * hp * wp} tokens but q/k have L={q.shape[1]} (dim 1)"
        )
    _check_int("start_frame", start_frame)
    if start_frame < 0:
        raise ValueError(f"start_frame must be >= 0, got {start_frame}")
    fp: list[int] | None = None
    if frame_positions is not None:
        if start_frame != 0:
            raise ValueError(
                f"pass either start_frame ({start_frame}) or frame_positions, not both: "
                "frame_positions already gives every frame's time position"
            )
        if isinstance(frame_positions, torch.Tensor):
            if (
                frame_positions.dim() != 1
                or frame_positions.is_floating_point()
                or frame_positions.is_complex()
            ):
                raise TypeError(
                    f"frame_positions tensor must be 1-D integer, got {frame_positions.dtype} "
                    f"shape {tuple(frame_positions.shape)}"
                )
            fp = [int(x) for x in frame_positions.tolist()]
        else:
            if isinstance(frame_positions, (str, bytes)) or not isinstance(frame_positions, Sequence):
                raise TypeError(
                    f"frame_positions must be a sequence of ints, got {type(frame_positions).__name__}"
                )
            for i, p in enumerate(frame_positions):
                _check_int(f"frame_positions[{i}]", p)
            fp = list(frame_positions)
        if len(fp) != f:
            raise ValueError(f"frame_positions must have length F={f} (grid[0]), got {len(fp)}")
        for i, p in enumerate(fp):
            if p < 0:
                raise ValueError(f"frame_positions[{i}] must be >= 0, got {p}")
    if max_positions is not None:
        _check_int("max_positions", max_positions)
        if max_positions < 1:
            raise ValueError(f"max_positions must be >= 1, got {max_positions}")
        t_max = max(fp) if fp is not None else start_frame + f - 1
        for label, top in (("time", t_max), ("height", hp - 1), ("width", wp - 1)):
            if top >= max_positions:
                raise ValueError(
                    f"max_positions={max_positions}: {label} position {top} is beyond the declared table "
                    f"(positions must be < max_positions; grid={tuple(grid)}, start_frame={start_frame}, "
                    f"frame_positions={'given' if fp is not None else None})"
                )
    be = _op_backend(backend)
    return _rope3d_op(q, k, [f, hp, wp], int(start_frame) if fp is None else 0, fp, be)


def _resolve_scale(scale: float | None, d: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(d)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be finite and > 0, got {scale}")
    return float(scale)


def _check_bool(name: str, x: Any) -> None:
    if not isinstance(x, bool):
        raise TypeError(f"{name} must be a bool, got {type(x).__name__}")


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    return_lse: bool = False,
    backend: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention reading and writing the per-head projection layout (no transposes).

    Args:
        q: ``[B, Lq, H, D]``; k, v: ``[B, Lk, H, D]``. Contiguous, one dtype (bf16 or fp32), same B, H, D;
            ``Lq, Lk >= 1`` (any length, not only multiples of 128).
        scale: softmax scale (finite, > 0), default ``1/sqrt(D)``.
        return_lse: also return the natural log-sum-exp of the scaled scores, ``[B, Lq, H]`` fp32.
        backend: see module docstring.

    Returns:
        ``out`` ``[B, Lq, H, D]`` in q's dtype, or ``(out, lse)`` when ``return_lse``. Statistics in fp32.
    """
    _check_tensor("q", q)
    _check_tensor("k", k)
    _check_tensor("v", v)
    _check_same(("q", "k", "v"), (q, k, v))
    _check_dims("k", k, "q", q, {0: "batch B", 2: "heads H", 3: "head_dim D"})
    _check_dims("v", v, "k", k, {0: "batch B", 1: "length Lk", 2: "heads H", 3: "head_dim D"})
    if q.shape[1] < 1:
        raise ValueError(f"q must have Lq >= 1 tokens, got shape {tuple(q.shape)}")
    if k.shape[1] < 1:
        raise ValueError(f"k must have Lk >= 1 tokens, got shape {tuple(k.shape)}")
    sc = _resolve_scale(scale, q.shape[3])
    _check_bool("return_lse", return_lse)
    be = _op_backend(backend)
    out, lse = _attention_op(q, k, v, sc, return_lse, be)
    return (out, lse) if return_lse else out


def check_segments(segments: Any, total: int, name: str = "segments") -> list[tuple[int, int]]:
    """Validate ordered ``(start, length)`` segments over ``total`` tokens; return them as int pairs.

    Rules: at least one segment; each ``length >= 1``, ``start >= 0``, ``start + length <= total``; no two
    segments overlap (order is free: keys follow the given order).
    """
    if isinstance(segments, (str, bytes)) or not isinstance(segments, Sequence) or len(segments) == 0:
        raise ValueError(f"{name} must be a non-empty sequence of (start, length) pairs, got {segments!r}")
    out: list[tuple[int, int]] = []
    for i, seg in enumerate(segments):
        if isinstance(seg, (str, bytes)) or not isinstance(seg, Sequence) or len(seg) != 2:
            raise ValueError(f"{name}[{i}] must be a (start, length) pair, got {seg!r}")
        s, n = seg
        _check_int(f"{name}[{i}].start", s)
        _check_int(f"{name}[{i}].length", n)
        if n < 1:
            raise ValueError(f"{name}[{i}] = ({s}, {n}) is empty: length must be >= 1")
        if s < 0 or s + n > total:
            raise ValueError(f"{name}[{i}] = ({s}, {n}) is out of bounds of the KV buffer [0, {total})")
        out.append((s, n))
    ordered = sorted(out)
    for (s0, n0), (s1, n1) in zip(ordered, ordered[1:]):
        if s0 + n0 > s1:
            raise ValueError(f"{name} overlap: ({s0}, {n0}) and ({s1}, {n1}) share tokens")
    return out


def attention_segments(
    q: torch.Tensor,
    kv_k: torch.Tensor,
    kv_v: torch.Tensor,
    segments: Sequence[tuple[int, int]],
    *,
    scale: float | None = None,
    return_lse: bool = False,
    backend: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of q over ordered segments of a KV buffer, read in place (never gathered by the kernel).

    Args:
        q: ``[B, Lq, H, D]``; kv_k, kv_v: KV buffers ``[B, S, H, D]`` (same shape). Contiguous, one dtype
            (bf16 or fp32), same B, H, D.
        segments: ordered, non-overlapping, non-empty ``(start, length)`` token ranges within ``[0, S)``;
            keys/values are their concatenation in the given order (the raw op receives them flattened
            as ``int[] [start0, length0, start1, length1, ...]``).
        scale, return_lse, backend: as in :func:`attention`.

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
    if q.shape[1] < 1:
        raise ValueError(f"q must have Lq >= 1 tokens, got shape {tuple(q.shape)}")
    segs = check_segments(segments, kv_k.shape[1])
    sc = _resolve_scale(scale, q.shape[3])
    _check_bool("return_lse", return_lse)
    be = _op_backend(backend)
    flat = [x for seg in segs for x in seg]
    out, lse = _attention_segments_op(q, kv_k, kv_v, flat, sc, return_lse, be)
    return (out, lse) if return_lse else out


def _check_cache_block(
    cache_k: torch.Tensor, cache_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    _check_tensor("cache_k", cache_k)
    _check_tensor("cache_v", cache_v)
    _check_tensor("k", k)
    _check_tensor("v", v)
    _check_same(("cache_k", "cache_v", "k", "v"), (cache_k, cache_v, k, v))
    if tuple(cache_v.shape) != tuple(cache_k.shape):
        raise ValueError(
            f"cache_v shape {tuple(cache_v.shape)} must equal cache_k shape {tuple(cache_k.shape)}"
        )
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v shape {tuple(v.shape)} must equal k shape {tuple(k.shape)}")
    _check_dims("k", k, "cache_k", cache_k, {0: "batch B", 2: "heads H", 3: "head_dim D"})
    if k.shape[1] < 1:
        raise ValueError(f"k must hold a block of T >= 1 tokens, got shape {tuple(k.shape)}")


def kv_cache_write(
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot: int,
    *,
    backend: str | None = None,
) -> None:
    """Write one block's k/v into ring slot ``slot`` in place: cache tokens ``[slot*T, (slot+1)*T)``.

    Args:
        cache_k, cache_v: ``[B, S, H, D]`` contiguous, mutated in place.
        k, v: ``[B, T, H, D]`` (same B, H, D and dtype as the caches; T >= 1).
        slot: ``0 <= slot`` and ``(slot+1)*T <= S``.
        backend: see module docstring.
    Only the T new tokens are touched.
    """
    _check_cache_block(cache_k, cache_v, k, v)
    _check_int("slot", slot)
    t, s = k.shape[1], cache_k.shape[1]
    if slot < 0 or (slot + 1) * t > s:
        raise ValueError(
            f"slot={slot} out of range: need 0 <= slot and (slot+1)*T <= S with T={t}, S={s} "
            f"(valid slots 0..{s // t - 1})"
        )
    be = _op_backend(backend)
    _kv_cache_write_op(cache_k, cache_v, k, v, int(slot), be)


def kv_cache_slide(
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sink_tokens: int,
    *,
    backend: str | None = None,
) -> None:
    """Contiguous-cache roll in place: keep the sink, evict the oldest block after it, append the new block.

    With T = k.shape[1], S = cache_k.shape[1]: tokens ``[sink_tokens + T, S)`` move to
    ``[sink_tokens, S - T)`` and k/v are written to ``[S - T, S)``.

    Args:
        cache_k, cache_v: ``[B, S, H, D]`` contiguous, mutated in place.
        k, v: ``[B, T, H, D]`` (same B, H, D and dtype as the caches; T >= 1).
        sink_tokens: pinned leading tokens, ``0 <= sink_tokens`` and ``sink_tokens + T <= S``.
        backend: see module docstring.
    """
    _check_cache_block(cache_k, cache_v, k, v)
    _check_int("sink_tokens", sink_tokens)
    t, s = k.shape[1], cache_k.shape[1]
    if sink_tokens < 0 or sink_tokens + t > s:
        raise ValueError(
            f"sink_tokens={sink_tokens} out of range: need 0 <= sink_tokens <= S - T = {s} - {t}"
        )
    be = _op_backend(backend)
    _kv_cache_slide_op(cache_k, cache_v, k, v, int(sink_tokens), be)


def _check_index_tensor(
    name: str, t: Any, shape: tuple[int, ...] | None = None, rank: int | None = None
) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be an integer torch.Tensor, got {type(t).__name__}")
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor (int32/int64), got {t.dtype}")
    if shape is not None and tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if rank is not None and t.dim() != rank:
        raise ValueError(f"{name} must have rank {rank}, got shape {tuple(t.shape)}")


def rope3d_positions(
    q: torch.Tensor,
    k: torch.Tensor,
    grid: Sequence[int],
    frame_positions: torch.Tensor,
    *,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rope3d` with the per-frame time positions given as a **tensor** (static-shape variant).

    Args:
        q, k: ``[B, L, H, D]`` as in :func:`rope3d`.
        grid: ``(F, Hp, Wp)`` Python ints (static), ``F*Hp*Wp == L``.
        frame_positions: integer tensor ``[F]`` of time positions (values checked when the op runs: each
            ``>= 0``). Being a tensor, new positions do not change a compiled graph (no recompilation).
        backend: see module docstring.

    Returns ``(q_rot, k_rot)`` like :func:`rope3d` (same reference, :func:`reference.rope3d.rope3d`).
    """
    _check_tensor("q", q)
    _check_tensor("k", k)
    _check_same(("q", "k"), (q, k))
    if tuple(k.shape) != tuple(q.shape):
        raise ValueError(f"k shape {tuple(k.shape)} must equal q shape {tuple(q.shape)} ([B, L, H, D])")
    if q.shape[3] % 2:
        raise ValueError(f"q/k head_dim D={q.shape[3]} must be even (interleaved complex pairs)")
    if isinstance(grid, (str, bytes)) or not isinstance(grid, Sequence) or len(grid) != 3:
        raise ValueError(f"grid must be a sequence (F, Hp, Wp) of 3 ints, got {grid!r}")
    for i, g in enumerate(grid):
        _check_int(f"grid[{i}]", g)
        if g < 1:
            raise ValueError(f"grid[{i}] must be >= 1, got grid={tuple(grid)}")
    f, hp, wp = (int(g) for g in grid)
    if f * hp * wp != q.shape[1]:
        raise ValueError(
            f"grid {tuple(grid)} gives F*Hp*Wp={f * hp * wp} tokens but q/k have L={q.shape[1]} (dim 1)"
        )
    _check_index_tensor("frame_positions", frame_positions, shape=(f,))
    return _rope3d_positions_op(q, k, [f, hp, wp], frame_positions, _op_backend(backend))


TABLE_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float64)
"""dtypes of RoPE cos/sin tables: float32 is what the kernels consume; float64 keeps the reference exact."""


def _check_grid(grid: Any) -> tuple[int, int, int]:
    if isinstance(grid, (str, bytes)) or not isinstance(grid, Sequence) or len(grid) != 3:
        raise ValueError(f"grid must be a sequence (F, Hp, Wp) of 3 ints, got {grid!r}")
    for i, g in enumerate(grid):
        _check_int(f"grid[{i}]", g)
        if g < 1:
            raise ValueError(f"grid[{i}] must be >= 1, got grid={tuple(grid)}")
    f, hp, wp = (int(g) for g in grid)
    return f, hp, wp


def rope_tables(
    grid: Sequence[int],
    head_dim: int,
    start_frame: int = 0,
    *,
    frame_positions: Sequence[int] | torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE ``(cos, sin)`` tables ``[L, head_dim//2]`` for :func:`rope3d_tables` (built once, shared).

    Args:
        grid: ``(F, Hp, Wp)`` Python ints >= 1; ``L = F*Hp*Wp``, rows in (f, h, w) row-major token order.
        head_dim: D, a positive even int (columns: time pairs, then height, then width, as :func:`rope3d`).
        start_frame: time position of frame 0 (>= 0); exclusive with a non-zero value and frame_positions.
        frame_positions: optional length-F time positions: a Python sequence of ints, or a 1-D integer
            tensor (values checked when the op runs: each >= 0; new values do not change a compiled graph).
        dtype: ``torch.float32`` (the kernels' operand dtype) or ``torch.float64`` (the reference's exact
            factors: :func:`rope3d_tables` with float64 tables is bitwise :func:`rope3d` on the reference
            backend; kernels round them to float32 per call, as :func:`rope3d` does).
        device: where the tables live (default: frame_positions' device if it is a tensor, else CPU).

    The values are :func:`reference.rope3d.rope_tables` (angles in float64); a custom op, so under
    ``torch.compile`` the tables are computed by that same code (not re-derived by the compiler).
    """
    f, hp, wp = _check_grid(grid)
    _check_int("head_dim", head_dim)
    if head_dim < 2 or head_dim % 2:
        raise ValueError(f"head_dim must be a positive even int (interleaved complex pairs), got {head_dim}")
    if not isinstance(dtype, torch.dtype) or dtype not in TABLE_DTYPES:
        raise TypeError(f"dtype must be one of {TABLE_DTYPES}, got {dtype!r}")
    _check_int("start_frame", start_frame)
    if start_frame < 0:
        raise ValueError(f"start_frame must be >= 0, got {start_frame}")
    if frame_positions is None:
        pos = torch.arange(f, dtype=torch.int64, device=device) + int(start_frame)
    else:
        if start_frame != 0:
            raise ValueError(
                f"pass either start_frame ({start_frame}) or frame_positions, not both: "
                "frame_positions already gives every frame's time position"
            )
        if isinstance(frame_positions, torch.Tensor):
            _check_index_tensor("frame_positions", frame_positions, shape=(f,))
            pos = frame_positions if device is None else frame_positions.to(device)
        else:
            if isinstance(frame_positions, (str, bytes)) or not isinstance(frame_positions, Sequence):
                raise TypeError(
                    f"frame_positions must be a sequence of ints or a tensor, got "
                    f"{type(frame_positions).__name__}"
                )
            if len(frame_positions) != f:
                raise ValueError(
                    f"frame_positions must have length F={f} (grid[0]), got {len(frame_positions)}"
                )
            for i, p in enumerate(frame_positions):
                _check_int(f"frame_positions[{i}]", p)
                if p < 0:
                    raise ValueError(f"frame_positions[{i}] must be >= 0, got {p}")
            pos = torch.tensor([int(p) for p in frame_positions], dtype=torch.int64, device=device)
    return _rope_tables_op(pos, [f, hp, wp], int(head_dim), dtype)


def rope3d_tables(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rope3d` of q and k with caller-built ``cos``/``sin`` tables (one launch; new tensors).

    Build the tables once (:func:`rope_tables`) and reuse them for every layer of a forward: the angles
    depend only on the token positions, never on the layer.

    Args:
        q, k: ``[B, L, H, D]`` contiguous, bf16 or fp32, identical shapes and dtypes; D even.
        cos, sin: ``[L, D//2]`` contiguous, float32 or float64 (both the same), on q's device; row l is
            token l of q/k (any positions: slicing rows of a larger table selects those tokens).
        backend: see module docstring. Reference: :func:`reference.rope3d.rope3d_tables`; kernels:
            :func:`nki_kernels.rope3d.rope3d_tables_emulated` (the ``rope3d_kernel`` with these tables).

    Returns ``(q_rot, k_rot)`` with q's shape and dtype.
    """
    _check_tensor("q", q)
    _check_tensor("k", k)
    _check_same(("q", "k"), (q, k))
    if tuple(k.shape) != tuple(q.shape):
        raise ValueError(f"k shape {tuple(k.shape)} must equal q shape {tuple(q.shape)} ([B, L, H, D])")
    if q.shape[3] % 2:
        raise ValueError(f"q/k head_dim D={q.shape[3]} must be even (interleaved complex pairs)")
    for name, t in (("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in TABLE_DTYPES:
            raise TypeError(f"{name} must be torch.float32 or torch.float64, got {t.dtype}")
        if t.dim() != 2 or t.shape[1] != q.shape[3] // 2:
            raise ValueError(
                f"{name} must be [L, D//2] = [L, {q.shape[3] // 2}] for q/k D={q.shape[3]}, "
                f"got shape {tuple(t.shape)}"
            )
        if t.shape[0] != q.shape[1]:
            raise ValueError(
                f"{name} has {t.shape[0]} rows (L, {name}.shape[0]) but q/k have L={q.shape[1]} tokens (dim 1)"
            )
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous [L, D//2]; call .contiguous()")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    if sin.dtype != cos.dtype:
        raise TypeError(f"sin dtype {sin.dtype} must match cos dtype {cos.dtype}")
    return _rope3d_tables_op(q, k, cos, sin, _op_backend(backend))


def kv_cache_write_at(
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot: torch.Tensor,
    *,
    backend: str | None = None,
) -> None:
    """:func:`kv_cache_write` with the slot given as a 0-d integer **tensor** (static-shape variant).

    Writes tokens ``[slot*T, (slot+1)*T)`` of ``cache_k, cache_v`` ``[B, S, H, D]`` in place with ``k, v``
    ``[B, T, H, D]``. The slot's range (``0 <= slot``, ``(slot+1)*T <= S``) is checked when the op runs.
    """
    _check_cache_block(cache_k, cache_v, k, v)
    _check_index_tensor("slot", slot, shape=())
    _kv_cache_write_at_op(cache_k, cache_v, k, v, slot, _op_backend(backend))


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
        if tuple(vs.shape) != tuple(ks.shape):
            raise ValueError(
                f"v_sources[{i}] shape {tuple(vs.shape)} must equal k_sources[{i}] shape {tuple(ks.shape)}"
            )
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
    be = _op_backend(backend)
    out, lse = _attention_block_table_op(
        q, list(k_sources), list(v_sources), block_table, [int(n) for n in q_groups], int(block_tokens),
        sc, return_lse, be,
    )  # fmt: skip
    return (out, lse) if return_lse else out


_KERNEL_ENTRIES: dict[str, tuple[str, str]] = {
    "rope3d": ("rope3d", "rope3d_emulated"),
    "rope3d_positions": ("rope3d", "rope3d_emulated"),
    "rope3d_tables": ("rope3d", "rope3d_tables_emulated"),
    "attention": ("attention", "attention_emulated"),
    "attention_segments": ("attention", "attention_segments_emulated"),
    "attention_block_table": BLOCK_TABLE_KERNEL,
    "kv_cache_write": ("kv_cache", "kv_cache_write_emulated"),
    "kv_cache_write_at": ("kv_cache", "kv_cache_write_emulated"),
    "kv_cache_slide": ("kv_cache", "kv_cache_slide_emulated"),
    "linear": ("linear", "linear_emulated"),
    "conv3d_causal": ("conv3d", "conv3d_causal_emulated"),
}


def has_kernel(op: str, backend: str | None = None) -> bool:
    """Whether public op ``op`` can run on ``backend`` (None: ``$NKI_ARDIFF_BACKEND``, else reference).

    Always True on ``"reference"``; on ``"emulator"`` / ``"neuron"`` True when the op's kernel entry point
    exists (it does not check that the real ``nki`` package is importable: the ops raise for that).
    """
    if op not in _KERNEL_ENTRIES:
        raise ValueError(f"op must be one of {sorted(_KERNEL_ENTRIES)}, got {op!r}")
    be = (
        backend
        if backend is not None
        else (os.environ.get(BACKEND_ENV, "").strip().lower() or DEFAULT_BACKEND)
    )
    if be not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {be!r}")
    if be == "reference":
        return True
    import importlib

    module, name = _KERNEL_ENTRIES[op]
    try:
        mod = importlib.import_module(f"nki_kernels.{module}")
    except ImportError:
        return False
    return callable(getattr(mod, name, None))


__all__ = [
    "LINEAR_MAX_K",
    "conv3d_causal",
    "conv_weight_taps",
    "linear",
    "BACKENDS",
    "BACKEND_ENV",
    "attention",
    "attention_block_table",
    "attention_segments",
    "check_segments",
    "has_kernel",
    "kv_cache_slide",
    "kv_cache_write",
    "kv_cache_write_at",
    "resolve_backend",
    "rope3d",
    "rope3d_positions",
    "rope3d_tables",
    "rope_tables",
]
