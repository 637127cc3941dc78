"""Backend resolution and kernel dispatch for :mod:`nki_kernels.ops` (one place for the rules of the module
docstring there): which backend a call uses, the kernel entry point of every op (written once, in
:data:`_KERNEL_ENTRIES`), and the checks of what a kernel returned."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from typing import Any, Literal, cast

import torch

Backend = Literal["reference", "emulator", "neuron"]
"""A backend name (the ops' ``backend`` argument also takes ``None``; a plain ``str`` is checked at call
time against :data:`BACKENDS`)."""

BACKENDS: tuple[Backend, ...] = ("reference", "emulator", "neuron")
"""Valid values of ``backend``."""


BACKEND_ENV = "NKI_ARDIFF_BACKEND"
"""Environment variable read at call time when ``backend=None``."""


DEFAULT_BACKEND: Backend = "reference"


def resolve_backend(backend: str | None = None) -> Backend:
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
    return cast(Backend, backend)


_AUTO = ""
"""Backend string the raw ops receive for ``backend=None``: resolved from the environment when the op runs,
so a compiled graph still honours ``NKI_ARDIFF_BACKEND`` at call time (dynamo would otherwise bake the
value read while tracing into the graph)."""


def _op_backend(backend: str | None) -> str:
    """Validate an explicit backend now; defer ``None`` to run time (see ``_AUTO``)."""
    return _AUTO if backend is None else resolve_backend(backend)


def _run_backend(backend: str) -> Backend:
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


BLOCK_TABLE_KERNEL = ("attention_block_table", "attention_block_table_emulated")
"""``(module, function)`` the kernel backends dispatch :func:`attention_block_table` to, with the signature
``fn(q, k_sources, v_sources, block_table, q_groups, block_tokens, scale=, return_lse=)`` returning ``out``
or ``(out, lse)``: :func:`nki_kernels.attention_block_table.attention_block_table_emulated` (the block table
is a runtime kernel input, so one compiled kernel serves every table of a given shape)."""


_KERNEL_ENTRIES: dict[str, tuple[str, str]] = {
    "rope3d": ("rope3d", "rope3d_emulated"),
    "rope3d_positions": ("rope3d", "rope3d_emulated"),
    "rope3d_tables": ("rope3d", "rope3d_tables_emulated"),
    "rope3d_tables_one": ("rope3d", "rope3d_one_tables_emulated"),
    "rope3d_positions_one": ("rope3d", "rope3d_one_emulated"),
    "attention": ("attention", "attention_emulated"),
    "attention_segments": ("attention", "attention_segments_emulated"),
    "attention_block_table": BLOCK_TABLE_KERNEL,
    "kv_cache_write": ("kv_cache", "kv_cache_write_emulated"),
    "kv_cache_write_at": ("kv_cache", "kv_cache_write_emulated"),
    "kv_cache_slide": ("kv_cache", "kv_cache_slide_emulated"),
    "linear": ("linear", "linear_emulated"),
    "linear_fp8": ("linear_fp8", "linear_fp8_emulated"),
    "conv3d_causal": ("conv3d", "conv3d_causal_emulated"),
    "adaln_norm_modulate": ("elementwise", "adaln_norm_modulate_emulated"),
    "gate_residual": ("elementwise", "gate_residual_emulated"),
    "rms_norm": ("elementwise", "rms_norm_emulated"),
    "gelu_tanh": ("elementwise", "gelu_tanh_emulated"),
    "gate_residual_adaln": ("elementwise_fused", "gate_residual_adaln_emulated"),
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


def _kernel(module: str, fn: str) -> Callable[..., Any]:
    """``nki_kernels.<module>.<fn>`` (imported on first use)."""
    mod = importlib.import_module(f"nki_kernels.{module}")
    return getattr(mod, fn)


def entry(op: str) -> Callable[..., Any]:
    """The kernel entry point public op ``op`` dispatches to on the kernel backends
    (:data:`_KERNEL_ENTRIES`)."""
    return _kernel(*_KERNEL_ENTRIES[op])
