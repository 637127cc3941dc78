"""The NKI shim: lazy resolution, the env switch, attribute caching and reset."""

from __future__ import annotations

import subprocess
import sys

import pytest

from nki_kernels import _nki


def _run(code: str, **env: str) -> str:
    import os

    full_env = {**os.environ, **env}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=full_env, check=True
    )
    return out.stdout.strip()


def test_import_does_no_work() -> None:
    # Importing the shim (and a kernel module through it) must not import the emulator or read the env.
    code = (
        "import sys, nki_kernels._nki as s, nki_kernels.ops;"
        "print('nki_kernels.emulator' in sys.modules, bool(s._resolved))"
    )
    assert _run(code) == "False False"


def test_env_forces_emulator() -> None:
    code = "from nki_kernels._nki import backend_name, nl; print(backend_name(), nl.float32)"
    assert _run(code, NKI_ARDIFF_BACKEND="emulator") == "emulator float32"


def test_attribute_cached_and_reset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NKI_ARDIFF_BACKEND", "emulator")
    _nki.reset()
    from nki_kernels import emulator

    assert _nki.nisa.nc_matmul is emulator.isa.nc_matmul
    assert "nc_matmul" in _nki.nisa.__dict__  # cached on the proxy: one dict lookup next time
    _nki.reset()
    assert "nc_matmul" not in _nki.nisa.__dict__
    assert not _nki._resolved
    assert _nki.backend_name() == "emulator"
