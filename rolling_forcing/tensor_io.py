"""Reading and checking tensor files: the rules the checkpoint loader (:mod:`rolling_forcing.checkpoint`)
and the precomputed prompt embeddings (:mod:`rolling_forcing.text`) share. Each caller passes the exception
type it documents (``CheckpointError`` there, ``ValueError`` here), so one rule keeps one wording."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file


def check_finite(t: torch.Tensor, what: str, error: type[Exception]) -> None:
    """Raise ``error("<what> has N non-finite values (NaN/inf)")`` when the floating tensor ``t`` holds any
    NaN or inf (a NaN/inf weight or embedding would stream a blank video without an error)."""
    bad = int((~torch.isfinite(t)).sum())
    if bad:
        raise error(f"{what} has {bad} non-finite values (NaN/inf)")


def load_safetensors(path: str | Path, error: type[Exception]) -> dict[str, torch.Tensor]:
    """``safetensors.torch.load_file`` on CPU; a truncated or corrupt file raises ``error`` naming the path
    (any other exception propagates unchanged)."""
    try:
        return load_file(str(path), device="cpu")
    except Exception as exc:  # safetensors' SafetensorError derives from Exception only
        if type(exc).__name__ != "SafetensorError":
            raise
        raise error(
            f"{str(path)!r} is not a readable .safetensors file (truncated or corrupt): {exc}"
        ) from None
