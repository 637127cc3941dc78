"""Import shims that let aws-neuron/nki-library's own test suite run on this project's emulator, unchanged.

nki-library's tests (``test/`` of github.com/aws-neuron/nki-library) have a CPU *simulation* mode
(``--test-mode simulation``): ``test/utils/simulation_setup.py`` aliases ``nki``, ``nki.language``,
``nki.isa`` ... to the modules of a ``nki_cpu_simulator`` package and runs each kernel as
``nki.cpu_simulate(kernel)[lnc](**inputs)``, then compares the outputs with the test's torch reference at the
test's own tolerances.  :func:`install` provides that package backed by :mod:`nki_kernels.emulator`, so the
kernels, the tests, their inputs and their comparisons are nki-library's own and nothing in the checkout is
edited.

It also provides, for the harness only:

* ``neuron_dtypes`` (an AWS package the tests use to cast inputs: ``static_cast``, ``sizeinbytes``,
  ``is_float_type``, ``finfo``, ``bfloat16``, the x4-packed fp8/fp4 names) on ml_dtypes, with
  round-to-nearest-even casts;
* ``neuronxcc.nki.typing`` (``tensor``/``mutable_tensor``, parameter annotations only) and
  ``neuronxcc.starfish.support.dtype`` (the ``neuron_dtypes`` stand-in): compiler-package names that a few
  kernels and tests import directly (router_topk, quantize_to_mx, qkv_cte);
* empty stand-ins for the client libraries that the suite's conftest imports for remote hosts, S3/SQS
  uploads, HTML reports and metrics (``boto3``, ``botocore``, ``fabric2``, ``paramiko``, ``pytest_html``,
  ``aws_embedded_metrics``, ``plotext``, ``scipy`` is *not* stubbed): simulation mode never calls them.
  Every attribute of a stand-in is an ``Exception`` subclass so ``except ClientError`` still parses; calling
  a stand-in function raises ``RuntimeError`` naming it.
"""

from __future__ import annotations

import dataclasses
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from typing import Any

import ml_dtypes
import numpy as np

STUBBED = ("boto3", "botocore", "fabric2", "paramiko", "pytest_html", "aws_embedded_metrics", "plotext")
"""Top-level modules replaced by empty stand-ins (never used in simulation mode)."""

MISSING_IN_CHECKOUT = ("test.utils.scripts", "test.utils.perf_analysis_private")
"""Modules the suite's conftest imports that the public checkout does not contain (remote core locking)."""


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        full = f"{self.__name__}.{name}"

        def _refuse(*a: Any, **k: Any) -> Any:
            raise RuntimeError(
                f"{full} is a stand-in of the nki-library harness (tools/nki_library_shims.py)"
            )

        cls = type(name, (Exception,), {"__module__": self.__name__, "stub_call": staticmethod(_refuse)})
        setattr(self, name, cls)
        return cls


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname.split(".")[0] in STUBBED or fullname.startswith(MISSING_IN_CHECKOUT):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> Any:
        mod = _StubModule(spec.name)
        mod.__path__ = []
        return mod

    def exec_module(self, module: Any) -> None:
        return None


# neuron_dtypes -------------------------------------------------------------------------------------------
_NP_DTYPES = {
    "bfloat16": ml_dtypes.bfloat16,
    "float8_e4m3": ml_dtypes.float8_e4m3,
    "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
    "float8_e5m2": ml_dtypes.float8_e5m2,
    "float4_e2m1fn": ml_dtypes.float4_e2m1fn,
}


def _np_dtype(dtype: Any) -> np.dtype:
    if isinstance(dtype, str) and dtype in _NP_DTYPES:
        return np.dtype(_NP_DTYPES[dtype])
    if isinstance(dtype, str) and dtype.endswith("_x4"):
        return np.dtype(np.uint32)
    return np.dtype(dtype)


def _static_cast(x: Any, dtype: Any) -> np.ndarray:
    """Cast ``x`` to ``dtype`` with round-to-nearest-even (float) or C truncation (float -> int)."""
    a = np.asarray(x)
    dt = _np_dtype(dtype)
    if dt.kind in "iu" and a.dtype.kind == "f":
        return np.trunc(a.astype(np.float64)).astype(dt)
    if a.dtype.kind == "V" or a.dtype in (np.dtype(d) for d in _NP_DTYPES.values()):
        a = a.astype(np.float32)
    return a.astype(dt)


def _make_neuron_dtypes() -> types.ModuleType:
    m = types.ModuleType("neuron_dtypes")
    m.__doc__ = "Stand-in of AWS's neuron_dtypes on ml_dtypes (tools/nki_library_shims.py)."
    for name, t in _NP_DTYPES.items():
        setattr(m, name, t)
    m.float8_e4m3fn_x4 = np.uint32
    m.float8_e5m2_x4 = np.uint32
    m.float4_e2m1fn_x4 = np.uint32
    m.static_cast = _static_cast
    m.sizeinbytes = lambda dtype: _np_dtype(dtype).itemsize
    m.is_float_type = lambda dtype: (
        _np_dtype(dtype).kind in "fV" or _np_dtype(dtype) in (np.dtype(d) for d in _NP_DTYPES.values())
    )
    m.finfo = lambda dtype: ml_dtypes.finfo(_np_dtype(dtype))
    return m


# nki_cpu_simulator ---------------------------------------------------------------------------------------
def _make_simulator() -> dict[str, types.ModuleType]:
    from nki_kernels.emulator import collectives, isa, language
    from nki_kernels.emulator import nki as emu_nki
    from nki_kernels.emulator.isa import constants

    nki_mod = types.ModuleType("nki_cpu_simulator.nki")
    nki_mod.__dict__.update({k: v for k, v in vars(emu_nki).items() if not k.startswith("__")})
    nki_mod.__path__ = []  # a package, so "nki.language" resolves through sys.modules
    nki_mod.isa = isa
    nki_mod.collectives = collectives

    def cpu_simulate(kernel: Any) -> Any:
        """``nki.cpu_simulate(kernel)[lnc](**inputs)``: the emulator's :func:`simulate`."""
        return emu_nki.simulate(kernel)

    nki_mod.cpu_simulate = cpu_simulate
    empty = {
        n: types.ModuleType(f"nki_cpu_simulator.nki.{n}") for n in ("builtin", "compiler", "tensor", "typing")
    }
    # ``nki.language`` as a copy of the emulator's namespace plus the ``dtypes`` submodule attribute (the
    # emulator's own module is left untouched)
    lang = types.ModuleType("nki_cpu_simulator.nki.language")
    lang.__dict__.update({k: v for k, v in vars(language).items() if not k.startswith("__")})
    lang.__path__ = []
    dtypes_mod = types.ModuleType("nki_cpu_simulator.nki.language.dtypes")
    for n in dir(language):
        v = getattr(language, n)
        if isinstance(v, str) and not n.startswith("_"):
            setattr(dtypes_mod, n, v)
    lang.dtypes = dtypes_mod
    nki_mod.language = lang
    pkg = types.ModuleType("nki_cpu_simulator")
    pkg.__path__ = []
    pkg.nki = nki_mod
    mods = {
        "nki_cpu_simulator": pkg,
        "nki_cpu_simulator.nki": nki_mod,
        "nki_cpu_simulator.nki.language": lang,
        "nki_cpu_simulator.nki.isa": isa,
        "nki_cpu_simulator.nki.isa.constants": constants,
        "nki_cpu_simulator.nki.language.dtypes": dtypes_mod,
        "nki_cpu_simulator.nki.collectives": collectives,
    }
    for n, m in empty.items():
        mods[f"nki_cpu_simulator.nki.{n}"] = m
        setattr(nki_mod, n, m)
    typing_mod = empty["typing"]
    for n in ("tensor", "mutable_tensor"):  # parameter annotations only (``x: nt.mutable_tensor``)
        setattr(typing_mod, n, type(n, (), {"__doc__": "annotation of an NKI kernel parameter (stand-in)"}))
    return mods


def _compiler_modules(
    typing_mod: types.ModuleType, dtypes_mod: types.ModuleType
) -> dict[str, types.ModuleType]:
    """The compiler package's names a few kernels/tests import directly: ``neuronxcc.nki.typing`` (the
    annotations of ``typing_mod``) and ``neuronxcc.starfish.support.dtype`` (``dtypes_mod``, the
    ``neuron_dtypes`` stand-in), as ``sys.modules`` entries with their parents."""
    mods: dict[str, types.ModuleType] = {}
    for name in ("neuronxcc", "neuronxcc.nki", "neuronxcc.starfish", "neuronxcc.starfish.support"):
        mods[name] = types.ModuleType(name)
        mods[name].__path__ = []
    mods["neuronxcc.nki.typing"] = typing_mod
    mods["neuronxcc.starfish.support.dtype"] = dtypes_mod
    for name in list(mods):
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(mods[parent], child, mods[name])
    return mods


def install() -> None:
    """Register the shims in ``sys.modules`` / ``sys.meta_path`` (idempotent).  ``nki``, ``nki.language``,
    ``nki.isa`` ... are aliased here already (the suite's conftest imports them before its own simulation
    setup re-aliases them to the same modules)."""
    if "nki_cpu_simulator" in sys.modules:
        return
    mods = _make_simulator()
    sys.modules.update(mods)
    # the suite's conftest imports ``nki.isa`` before its simulation setup runs: alias up front
    for name, mod in mods.items():
        if name.startswith("nki_cpu_simulator.nki"):
            sys.modules[name.removeprefix("nki_cpu_simulator.")] = mod
    sys.modules["neuron_dtypes"] = _make_neuron_dtypes()
    sys.modules.update(_compiler_modules(mods["nki_cpu_simulator.nki.typing"], sys.modules["neuron_dtypes"]))
    if importlib.util.find_spec("attr") is None:  # host management's ``from attr import dataclass``
        attr = types.ModuleType("attr")
        attr.dataclass = dataclasses.dataclass
        sys.modules["attr"] = attr
    sys.meta_path.insert(0, _StubFinder())
