"""Shared inputs of the ``nki_kernels.ops`` tests (tests/test_ops*.py)."""

from __future__ import annotations

import importlib

import pytest
import torch

from nki_kernels import ops

BF16, F32 = torch.bfloat16, torch.float32


def rnd(*shape: int, dtype: torch.dtype = F32, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def zeros(*shape: int, dtype: torch.dtype = F32) -> torch.Tensor:
    return torch.zeros(*shape, dtype=dtype)


Q = zeros(2, 12, 3, 16)
KV = zeros(2, 20, 3, 16)


def kernels_available(module: str) -> None:
    """The kernel module must import: a broken kernel fails these tests, it is never skipped."""
    importlib.import_module(f"nki_kernels.{module}")


@pytest.fixture(autouse=True)
def clean_backend_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No test inherits ``NKI_ARDIFF_BACKEND`` from the environment (import it into a test module)."""
    monkeypatch.delenv(ops.BACKEND_ENV, raising=False)
