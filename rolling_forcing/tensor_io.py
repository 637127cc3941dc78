"""Reading and checking tensor files: the rules the checkpoint loader (:mod:`rolling_forcing.checkpoint`)
and the precomputed prompt embeddings (:mod:`rolling_forcing.text`) share. Each caller passes the exception
type it documents (``CheckpointError`` there, ``ValueError`` here), so one rule keeps one wording."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file


def check_finite(t: torch.Tensor, what: str, error: type[Exception]) -> None:
    """Raise ``error("<what> has N non-finite values (NaN/inf)")`` when the floating tensor ``t`` holds any
    NaN or inf (a NaN/inf weight or embedding would stream a blank video without an error)."""
    bad = int((~torch.isfinite(t)).sum())
    if bad:
        raise error(f"{what} has {bad} non-finite values (NaN/inf)")


def _corrupt(exc: Exception, path: str | Path, error: type[Exception]) -> Exception:
    """The ``error`` for a truncated or corrupt file, or ``exc`` itself when it is not safetensors' own."""
    if type(exc).__name__ != "SafetensorError":  # safetensors' SafetensorError derives from Exception only
        return exc
    return error(f"{str(path)!r} is not a readable .safetensors file (truncated or corrupt): {exc}")


def load_safetensors(path: str | Path, error: type[Exception]) -> dict[str, torch.Tensor]:
    """``safetensors.torch.load_file`` on CPU; a truncated or corrupt file raises ``error`` naming the path
    (any other exception propagates unchanged)."""
    try:
        return load_file(str(path), device="cpu")
    except Exception as exc:
        raise _corrupt(exc, path, error) from None


def read_safetensors(
    path: str | Path, error: type[Exception]
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors (on CPU) and the metadata of a safetensors file in one read; a truncated or corrupt file
    raises ``error`` naming the path, as :func:`load_safetensors`."""
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
    except Exception as exc:
        raise _corrupt(exc, path, error) from None
    return tensors, meta
