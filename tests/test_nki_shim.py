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


def test_kernel_modules_import_without_resolving() -> None:
    # @nki.jit at a kernel module's top level defers to the first launch: importing every kernel module
    # must not resolve the backend (no env read, no `import nki` probe, no emulator import).
    mods = (
        "nki_kernels.rope3d, nki_kernels.attention, nki_kernels.kv_cache, nki_kernels.attention_block_table"
    )
    code = (
        f"import sys, nki_kernels._nki as s; import {mods};"
        "print('nki_kernels.emulator' in sys.modules, bool(s._resolved),"
        " type(nki_kernels.attention.attention_kernel).__name__)"
    )
    assert _run(code) == "False False LazyKernel"
    # The benchmark imports the emulator's tracing API (a plain import), but still resolves nothing.
    assert _run("import nki_kernels._nki as s, perf.bench_kernels; print(bool(s._resolved))") == "False"


def test_lazy_kernel_launches_on_the_emulator(monkeypatch: pytest.MonkeyPatch) -> None:
    import numpy as np

    monkeypatch.setenv("NKI_ARDIFF_BACKEND", "emulator")
    _nki.reset()
    nki, nl, nisa = _nki.nki, _nki.nl, _nki.nisa

    @nki.jit
    def double(x):  # type: ignore[no-untyped-def]
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        t = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=2.0)
        nisa.dma_copy(dst=out, src=t)
        return out

    assert isinstance(double, _nki.LazyKernel)
    x = np.arange(8 * 16, dtype=np.float32).reshape(8, 16)
    direct = double(x)  # resolves on first call
    launched, trace = _nki.launch(double, x, lnc=1)
    np.testing.assert_array_equal(direct, 2 * x)
    np.testing.assert_array_equal(launched, 2 * x)
    assert trace is not None and trace.count(op="dma_copy") == 2


def test_launch_goes_to_real_nki_when_it_imports(monkeypatch: pytest.MonkeyPatch) -> None:
    # A stand-in `nki` package: with it importable, launches must go through its jit and kernel[lnc],
    # never through the emulator (the neuron backend must not silently emulate).
    import types

    calls: list[tuple[str, object]] = []

    class FakeKernel:
        def __init__(self, fn: object, lnc: int = 1) -> None:
            self.fn, self.lnc = fn, lnc

        def __getitem__(self, lnc: int) -> FakeKernel:
            return FakeKernel(self.fn, lnc)

        def __call__(self, *args: object) -> str:
            calls.append(("call", self.lnc))
            return "device-result"

    fake = types.ModuleType("nki")
    fake.jit = lambda fn=None, **kw: FakeKernel(fn)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "nki", fake)
    monkeypatch.setitem(sys.modules, "nki.language", types.ModuleType("nki.language"))
    monkeypatch.setitem(sys.modules, "nki.isa", types.ModuleType("nki.isa"))
    monkeypatch.delenv("NKI_ARDIFF_BACKEND", raising=False)
    _nki.reset()
    try:
        kernel = _nki.nki.jit(lambda x: x)
        assert _nki.backend_name() == "nki"
        out, trace = _nki.launch(kernel, 1, lnc=2)
        assert (out, trace) == ("device-result", None)
        assert calls == [("call", 2)]
    finally:
        _nki.reset()
