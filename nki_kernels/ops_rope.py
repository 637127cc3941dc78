"""The 3D RoPE ops (``rope3d``, ``rope3d_positions``, ``rope_tables``, ``rope3d_tables``,
``rope3d_tables_one``, ``rope3d_positions_one``): raw ``torch.library`` ops with their fakes and the public
functions, re-exported by :mod:`nki_kernels.ops` (which documents the backend and validation rules every op
follows)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nki_kernels import op_dispatch as _d
from nki_kernels.op_checks import (
    TABLE_DTYPES,
    _check_grid,
    _check_grid_tokens,
    _check_index_tensor,
    _check_int,
    _check_positions_nonneg,
    _check_qk_pair,
    _check_tensor,
    _int_values,
)
from nki_kernels.op_dispatch import (
    _op_backend,
    _rope_outputs,
    _run_backend,
)


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
    fn = _d.entry("rope3d")
    qo, ko = fn(q, k, tuple(grid), start_frame=start_frame, frame_positions=fp)
    return _rope_outputs(qo, ko, q, k)


@_rope3d_op.register_fake
def _(q, k, grid, start_frame, frame_positions, backend):
    return torch.empty_like(q), torch.empty_like(k)


@torch.library.custom_op("nki_ardiff::rope3d_positions", mutates_args=())
def _rope3d_positions_op(
    q: torch.Tensor, k: torch.Tensor, grid: list[int], frame_positions: torch.Tensor, backend: str
) -> tuple[torch.Tensor, torch.Tensor]:
    fp = [int(x) for x in _int_values("frame_positions", frame_positions)]
    _check_positions_nonneg(fp)
    if _run_backend(backend) == "reference":
        from reference.rope3d import rope3d as ref_rope3d

        return ref_rope3d(q, k, tuple(grid), 0, fp)
    # the rope kernel already takes per-frame positions as runtime values (host-built cos/sin tables)
    fn = _d.entry("rope3d")
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
    _check_positions_nonneg(fp)
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
    qo, ko = _d.entry("rope3d_tables")(q, k, cos, sin)
    return _rope_outputs(qo, ko, q, k)


@_rope3d_tables_op.register_fake
def _(q, k, cos, sin, backend):
    return torch.empty_like(q), torch.empty_like(k)


@torch.library.custom_op("nki_ardiff::rope3d_tables_one", mutates_args=())
def _rope3d_tables_one_op(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: str
) -> torch.Tensor:
    if _run_backend(backend) == "reference":
        from reference.rope3d import rope3d_tables_one as ref_one

        return ref_one(x, cos, sin)
    xo = _d.entry("rope3d_tables_one")(x, cos, sin)
    return _rope_outputs(xo, xo, x, x)[0]


@_rope3d_tables_one_op.register_fake
def _(x, cos, sin, backend):
    return torch.empty_like(x)


@torch.library.custom_op("nki_ardiff::rope3d_positions_one", mutates_args=())
def _rope3d_positions_one_op(
    x: torch.Tensor, grid: list[int], frame_positions: torch.Tensor, backend: str
) -> torch.Tensor:
    fp = [int(p) for p in _int_values("frame_positions", frame_positions)]
    _check_positions_nonneg(fp)
    if _run_backend(backend) == "reference":
        from reference.rope3d import rope3d_tables_one as ref_one
        from reference.rope3d import rope_tables as ref_tables

        cos, sin = ref_tables(tuple(grid), x.shape[3], 0, fp, dtype=torch.float64)
        return ref_one(x, cos.to(x.device), sin.to(x.device))
    xo = _d.entry("rope3d_positions_one")(x, tuple(grid), frame_positions=fp)
    return _rope_outputs(xo, xo, x, x)[0]


@_rope3d_positions_one_op.register_fake
def _(x, grid, frame_positions, backend):
    return torch.empty_like(x)


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
    _check_qk_pair(q, k)
    f, hp, wp = _check_grid_tokens(grid, q.shape[1])
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
        _check_positions_nonneg(fp)
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
    _check_qk_pair(q, k)
    f, hp, wp = _check_grid_tokens(grid, q.shape[1])
    _check_index_tensor("frame_positions", frame_positions, shape=(f,))
    return _rope3d_positions_op(q, k, [f, hp, wp], frame_positions, _op_backend(backend))


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
            _check_positions_nonneg(frame_positions)
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
    _check_qk_pair(q, k)
    _check_tables(q, cos, sin, "q/k")
    return _rope3d_tables_op(q, k, cos, sin, _op_backend(backend))


def rope3d_tables_one(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """RoPE of ONE tensor with caller-built tables (one launch; a new tensor): :func:`rope3d_tables` for a
    caller that needs only q or only k, e.g. the keys of a roped cache copy, at half the traffic and work.

    Args:
        x: ``[B, L, H, D]`` contiguous, bf16 or fp32; D even.
        cos, sin: ``[L, D//2]`` contiguous, float32 or float64 (both the same), on x's device.
        backend: see module docstring. Reference: :func:`reference.rope3d.rope3d_tables_one`; kernels:
            :func:`nki_kernels.rope3d.rope3d_one_tables_emulated` (``rope3d_one_kernel``).

    Returns ``x_rot`` with x's shape and dtype: bitwise :func:`rope3d_tables`'s ``k_rot`` for ``k = x`` on
    the same backend (the kernel runs the same tiling and arithmetic on one input).
    """
    _check_tensor("x", x)
    if x.shape[3] % 2:
        raise ValueError(f"x head_dim D={x.shape[3]} must be even (interleaved complex pairs)")
    _check_tables(x, cos, sin, "x")
    return _rope3d_tables_one_op(x, cos, sin, _op_backend(backend))


def rope3d_positions_one(
    x: torch.Tensor,
    grid: Sequence[int],
    frame_positions: torch.Tensor,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """:func:`rope3d_positions` of ONE tensor (e.g. the keys of a roped cache copy; a new tensor).

    Args:
        x: ``[B, L, H, D]`` contiguous, bf16 or fp32; D even.
        grid: ``(F, Hp, Wp)`` Python ints (static), ``F*Hp*Wp == L``.
        frame_positions: integer tensor ``[F]`` of time positions (each ``>= 0``, checked when the op runs).
        backend: see module docstring. Reference: :func:`reference.rope3d.rope3d_tables_one` with float64
            :func:`reference.rope3d.rope_tables`; kernels: :func:`nki_kernels.rope3d.rope3d_one_emulated`.

    Returns ``x_rot``: bitwise :func:`rope3d_positions`'s ``k_rot`` for ``k = x`` on the same backend, at
    half its traffic and work. A static-shape variant of :func:`rope3d_tables_one` (tables built inside).
    """
    _check_tensor("x", x)
    if x.shape[3] % 2:
        raise ValueError(f"x head_dim D={x.shape[3]} must be even (interleaved complex pairs)")
    f, hp, wp = _check_grid_tokens(grid, x.shape[1])
    _check_index_tensor("frame_positions", frame_positions, shape=(f,))
    return _rope3d_positions_one_op(x, [f, hp, wp], frame_positions, _op_backend(backend))


def _check_tables(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, what: str) -> None:
    """cos/sin must be contiguous float32/float64 ``[L, D//2]`` tensors of x's L and D, on x's device."""
    q = x
    for name, t in (("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in TABLE_DTYPES:
            raise TypeError(f"{name} must be torch.float32 or torch.float64, got {t.dtype}")
        if t.dim() != 2 or t.shape[1] != q.shape[3] // 2:
            raise ValueError(
                f"{name} must be [L, D//2] = [L, {q.shape[3] // 2}] for {what} D={q.shape[3]}, "
                f"got shape {tuple(t.shape)}"
            )
        if t.shape[0] != q.shape[1]:
            raise ValueError(
                f"{name} has {t.shape[0]} rows (L, {name}.shape[0]) but {what} has L={q.shape[1]} "
                "tokens (dim 1)"
            )
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous [L, D//2]; call .contiguous()")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but {what.split('/')[0]} is on {q.device}")
    if sin.dtype != cos.dtype:
        raise TypeError(f"sin dtype {sin.dtype} must match cos dtype {cos.dtype}")
