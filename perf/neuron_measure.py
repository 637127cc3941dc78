"""Measured trn2 kernel latency for ``rolling-forcing bench kernels --backend neuron --measure``: bench rows
of kind ``"measured"`` in the schema of the modelled rows (:class:`perf.runner.BenchRow`), each beside the
cost model's figure for the same launch (:mod:`perf.neuron_points` turns them into calibration points).

**Written against the documented Neuron tools, never run in this repository's development (no Neuron
device there).** On a machine without a device, the real ``nki`` package or the profiler CLI,
:func:`require_measure` raises :class:`NeuronUnavailable` naming what is missing, before any case runs.

The documented route (Neuron docs, "Profile a NKI Kernel",
https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/guides/use-neuron-profile.html; NKI 0.6 has no
``nki.benchmark`` / ``nki.profile``, "not available with NKI 0.2.0" per the NKI release notes,
https://awsdocs-neuron.readthedocs-hosted.com/en/latest/release-notes/components/nki.html), per case:

1. a child process with ``NEURON_FRAMEWORK_DEBUG=1`` (the compiler then saves the kernel's NEFF in the
   current directory), ``NEURON_LOGICAL_NC_CONFIG=<lnc>`` (must match the launch's ``kernel[lnc]``, per the
   ``nki.jit`` API page) and ``NEURON_PLATFORM_TARGET_OVERRIDE=trn2`` unless already set, in a directory of
   its own, launches the case's kernel once on zero-filled numpy arrays of the case's shapes (numpy
   arguments: ``nki.jit`` compiles and executes the kernel standalone, without a framework);
2. ``neuron-explorer capture -n <neff> -s profile.ntff --profile-nth-exec=2`` executes the NEFF on the
   device and records the second execution (the first carries one-time warm-up), as the guide does; with no
   inputs given the tool zero-fills them ("CLI profiling with neuron-explorer capture",
   https://awsdocs-neuron.readthedocs-hosted.com/en/latest/tools/neuron-explorer/how-to-profile-workload.html).
   Zero inputs are valid for every kernel here (index inputs of 0 are in range) and none of them has
   data-dependent control flow, so the time does not depend on the values;
3. ``neuron-explorer view -n <neff> -s <ntff> --output-format summary-json`` prints the profile summary;
   its ``total_time`` (seconds) is "the hardware-measured wall-clock time from execution start to execution
   end ... not including host-side overhead" (Profile Schema Reference, Summary table,
   https://awsdocs-neuron.readthedocs-hosted.com/en/latest/tools/neuron-explorer/profile-schema-reference.html).
   The summary schema "may change between versions" (Neuron Explorer troubleshooting): the parser looks
   for the first ``total_time`` anywhere in the JSON and fails loudly when there is none.

A row's ``latency_us`` is the measured time of **one launch as the case configures it** (for attention
cases: the ``traced_heads`` heads of the modelled case, not a whole layer; ``extra["layer_scale"]`` is the
factor the modelled row applies to reach a layer). Every row also carries the cost model's figure for the
very same launch, computed in the same run (``extra["modelled_kernel_us"]``, same code version), so a
measured/modelled ratio compares like with like whatever per-layer convention the modelled table uses.

Ingestion of the rows as calibration points: :mod:`perf.neuron_points`.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from perf.runner import BenchRow, run_case

__all__ = [
    "ExplorerTiming",
    "KernelCall",
    "NeuronUnavailable",
    "Timing",
    "TimingSource",
    "add_measure_args",
    "attach_call",
    "call_of",
    "check_measure_args",
    "cost_model",
    "measure_rows",
    "modelled_launch_us",
    "parse_total_time_s",
    "require_measure",
    "run_measure",
]

_ROOT = Path(__file__).resolve().parent.parent
"""The checkout holding ``perf/`` and ``nki_kernels/``."""

NTH_EXEC = 2
"""Profiled execution (``--profile-nth-exec``): the second, as the NKI profiling guide recommends."""


class NeuronUnavailable(RuntimeError):
    """The measure path cannot run here; the message names what is missing."""


@dataclass(frozen=True)
class KernelCall:
    """One benchmark case's kernel launch, attached to its modelled case function by
    :func:`attach_call`.

    Attributes:
        kernel: the ``@nki.jit`` kernel (a :class:`nki_kernels._nki.LazyKernel`, module-level).
        args: the launch arguments as in the modelled case (``TensorSpec`` for tensors, lists of them for
            lists of tensors, Python scalars and tuples as they are).
        lnc: logical NeuronCores of the launch (1 or 2).
        kwargs: keyword arguments of the launch as sorted ``(name, value)`` pairs (compile-time
            constants such as a calibration kernel's ``reps``; picklable values only).
        layer_scale: the factor the modelled row applies to this launch's work to report a layer (attention:
            H / (lnc x traced heads per core); 1 otherwise). Informative: measured rows are not scaled.
        layer_is: how the modelled row reaches a layer from this launch (shown in measured rows).
    """

    kernel: Any
    args: tuple[Any, ...]
    lnc: int = 1
    layer_scale: float = 1.0
    layer_is: str = "the launch is the layer's whole op"
    kwargs: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if self.lnc not in (1, 2):
            raise ValueError(f"KernelCall.lnc must be 1 or 2, got {self.lnc}")
        if any(not (isinstance(kv, tuple) and len(kv) == 2 and isinstance(kv[0], str)) for kv in self.kwargs):
            raise ValueError(f"KernelCall.kwargs must be (name, value) pairs, got {self.kwargs!r}")
        if not self.layer_scale > 0:
            raise ValueError(f"KernelCall.layer_scale must be > 0, got {self.layer_scale}")

    def kernel_ref(self) -> str:
        """``"module:name"`` of the kernel, importable by a child process."""
        fn = getattr(self.kernel, "fn", self.kernel)
        return f"{fn.__module__}:{fn.__name__}"


def attach_call(fn: Callable[[], Any], call: KernelCall) -> Callable[[], Any]:
    """Record on a benchmark case function which kernel launch it models; returns ``fn``."""
    fn.kernel_call = call  # type: ignore[attr-defined]
    return fn


def call_of(fn: Callable[[], Any]) -> KernelCall | None:
    """The :class:`KernelCall` attached to a case function, or None."""
    call = getattr(fn, "kernel_call", None)
    return call if isinstance(call, KernelCall) else None


@dataclass(frozen=True)
class Timing:
    """A measured kernel time: ``kernel_us`` (device time of one execution), where it comes from, and
    further details (artifact paths, tool) copied into the row's ``extra``."""

    kernel_us: float
    source: str
    details: Mapping[str, Any] = field(default_factory=dict)


class TimingSource(Protocol):
    """Times one kernel launch on the device (``name``: a file-safe case name)."""

    def __call__(self, call: KernelCall, name: str) -> Timing: ...


def require_measure(probe_result: Any = None) -> str:
    """The profiler executable's path, or :class:`NeuronUnavailable` saying what is missing (a Neuron
    device, the real ``nki`` package, ``neuron-explorer``). ``probe_result``: a
    :class:`nki_kernels.neuron_probe.NeuronProbe` (default: probe now)."""
    if probe_result is None:
        from nki_kernels.neuron_probe import probe

        probe_result = probe()
    reason = probe_result.reason(("device", "nki", "profiler"))
    if reason:
        raise NeuronUnavailable(
            f"--measure times the kernels on a Neuron device and cannot run here: {reason}. "
            "The modelled figures need neither: run without --backend neuron --measure (docs/neuron.md)."
        )
    return str(probe_result.profiler)


def parse_total_time_s(text: str) -> float:
    """``total_time`` (seconds) from ``neuron-explorer view --output-format summary-json`` output: the
    first ``total_time`` key found depth-first (a summary object, or a list of them)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"profiler summary is not JSON ({exc}): {text[:200]!r}") from exc
    stack = [data]
    while stack:
        node = stack.pop(0)
        if isinstance(node, Mapping):
            if "total_time" in node:
                value = float(node["total_time"])
                if not value > 0:
                    raise ValueError(f"profiler summary total_time must be > 0 seconds, got {value}")
                return value
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    raise ValueError(f"profiler summary has no total_time: {text[:200]!r}")


Runner = Callable[..., subprocess.CompletedProcess]


def _newest(directory: Path, pattern: str) -> Path | None:
    found = sorted(directory.rglob(pattern), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


@dataclass(frozen=True)
class ExplorerTiming:
    """The documented route (module docstring): compile and run in a child, capture, read the summary.

    Attributes:
        workdir: one sub-directory per case holds the NEFF, the NTFF and the child's pickled call.
        profiler: ``neuron-explorer`` (or ``neuron-profile``) executable.
        runner: runs a command (``subprocess.run`` signature; tests inject a fake).
        python: interpreter for the child (default: this one).
    """

    workdir: Path
    profiler: str
    runner: Runner = subprocess.run
    python: str = sys.executable

    def __call__(self, call: KernelCall, name: str) -> Timing:
        case = Path(self.workdir) / name
        case.mkdir(parents=True, exist_ok=True)
        spec = case / "call.pkl"
        payload: tuple[Any, ...] = (call.kernel_ref(), call.args, call.lnc)
        spec.write_bytes(pickle.dumps(payload + ((call.kwargs,) if call.kwargs else ())))
        env = dict(os.environ)
        env.update({"NEURON_FRAMEWORK_DEBUG": "1", "NEURON_LOGICAL_NC_CONFIG": str(call.lnc)})
        env.setdefault("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
        # the child runs in the case directory: make this checkout importable there
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_ROOT), env.get("PYTHONPATH", "")) if p)
        self._run(
            [self.python, "-m", "perf.neuron_measure", "run-kernel", str(spec)], case, env, "compile+run"
        )
        neff = _newest(case, "*.neff")
        if neff is None:
            raise RuntimeError(
                f"no .neff under {case} after the kernel ran with NEURON_FRAMEWORK_DEBUG=1 (the compiler "
                "should have saved it there: NKI guide 'Profile a NKI Kernel', step 1)"
            )
        self._run(
            [self.profiler, "capture", "-n", str(neff), "-s", str(case / "profile.ntff"),
             f"--profile-nth-exec={NTH_EXEC}"],
            case, None, "capture",
        )  # fmt: skip
        ntff = case / f"profile_exec_{NTH_EXEC}.ntff"
        if not ntff.exists():
            ntff = _newest(case, "*.ntff") or ntff
        if not ntff.exists():
            raise RuntimeError(f"{self.profiler} capture wrote no .ntff under {case}")
        out = self._run(
            [self.profiler, "view", "-n", str(neff), "-s", str(ntff), "--output-format", "summary-json"],
            case, None, "view",
        )  # fmt: skip
        seconds = parse_total_time_s(out)
        return Timing(
            kernel_us=seconds * 1e6,
            source=f"{Path(self.profiler).name} summary total_time, execution {NTH_EXEC}, zero inputs",
            details={"neff": str(neff), "ntff": str(ntff), "total_time_s": seconds},
        )

    def _run(self, cmd: list[str], cwd: Path, env: Mapping[str, str] | None, what: str) -> str:
        res = self.runner(cmd, cwd=cwd, env=env, capture_output=True, text=True, check=False)
        if res.returncode != 0:
            tail = (res.stderr or res.stdout or "").strip()[-400:]
            raise RuntimeError(f"{what} failed (exit {res.returncode}): {' '.join(cmd)}: {tail}")
        return str(res.stdout)


def _zeros(args: Any) -> Any:
    """Zero numpy arrays for every ``TensorSpec`` (lists/tuples walked), other values unchanged."""
    import numpy as np

    from nki_kernels.emulator import TensorSpec
    from nki_kernels.emulator.dtypes import storage_dtype

    if isinstance(args, TensorSpec):
        return np.zeros(args.shape, dtype=storage_dtype(args.dtype))
    if isinstance(args, list):
        return [_zeros(a) for a in args]
    if isinstance(args, tuple) and any(isinstance(a, (TensorSpec, list)) for a in args):
        return tuple(_zeros(a) for a in args)
    return args


def _run_kernel(spec_path: str) -> None:
    """Child of :class:`ExplorerTiming`: launch the pickled call once through the real ``nki``
    (``(ref, args, lnc)`` or ``(ref, args, lnc, kwargs)``; a plain kernel function, such as a
    calibration kernel, is wrapped in ``nki.jit`` through the shim's :class:`LazyKernel`)."""
    import importlib

    from nki_kernels import _nki

    ref, args, lnc, *rest = pickle.loads(Path(spec_path).read_bytes())
    kwargs = dict(rest[0]) if rest else {}
    if _nki.backend_name() != "nki":
        raise SystemExit("run-kernel: the real nki package is not importable (the shim chose the emulator)")
    module, name = ref.split(":")
    kernel = getattr(importlib.import_module(module), name)
    if not isinstance(kernel, _nki.LazyKernel):
        kernel = _nki.LazyKernel(kernel, {})
    _nki.launch(kernel, *_zeros(args), lnc=lnc, **kwargs)


def add_measure_args(ap: argparse.ArgumentParser) -> None:
    """``--backend {emulator,neuron}``, ``--measure`` and ``--workdir`` of ``perf.bench_kernels``."""
    ap.add_argument(
        "--backend",
        choices=("emulator", "neuron"),
        default="emulator",
        help="emulator: modelled rows (trace + cost model); neuron: measured, with --measure",
    )
    ap.add_argument(
        "--measure",
        action="store_true",
        help="time every case on a Neuron device (perf/neuron_measure.py; kind=measured rows)",
    )
    ap.add_argument(
        "--workdir", default=None, help="--measure: directory for NEFF/NTFF (default: a temp dir)"
    )


def check_measure_args(ap: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """``--measure`` and ``--backend neuron`` go together (argparse error, exit 2, otherwise)."""
    if a.measure != (a.backend == "neuron"):
        ap.error(
            "--measure and --backend neuron go together (the emulator backend models, it does not measure)"
        )


ModelFn = Callable[[Any, int], tuple[float, str]]
"""``(trace, cores) -> (latency_ns, bottleneck engine)``: a cost-model adapter for one traced launch."""


def cost_model(trace: Any, cores: int) -> tuple[float, str]:
    """Default :data:`ModelFn`: ``nki_kernels.emulator.cost.profile`` (the project's cost model)."""
    from nki_kernels.emulator.cost import profile

    prof = profile(trace, cores=cores)
    return float(prof.latency_ns), str(prof.bottleneck)


def modelled_launch_us(call: KernelCall, model: ModelFn | None = None) -> tuple[float, str]:
    """The cost model's time (us) and bottleneck engine for exactly the launch ``call`` describes: a
    trace-only emulator run of ``call.kernel`` on ``call.args`` with ``call.lnc``, modelled by ``model``
    (default :func:`cost_model`) on ``lnc`` cores, traced with the event log (``keep_events``) so the
    cost model prices it by its dependency-aware schedule."""
    from nki_kernels.emulator import run

    _, trace = run(
        call.kernel, *call.args, lnc=call.lnc, trace_only=True, keep_events=True, **dict(call.kwargs)
    )
    ns, bottleneck = (model or cost_model)(trace, call.lnc)
    return ns / 1e3, bottleneck


def _modelled_partner(call: KernelCall) -> dict[str, Any]:
    """The launch's modelled figures for the row's ``extra`` (or why they are missing)."""
    try:
        us, bottleneck = modelled_launch_us(call)
    except Exception as exc:  # the measurement stands; say why its modelled partner is missing
        return {"modelled_error": f"{type(exc).__name__}: {exc}"[:300]}
    return {"modelled_kernel_us": us, "modelled_bottleneck": bottleneck}


def measure_rows(
    cases: Sequence[tuple[str, str, Mapping[str, Any], Callable[[], Any]]],
    timing: TimingSource,
    *,
    with_model: bool = True,
) -> list[BenchRow]:
    """One ``kind="measured"`` row per benchmark case (``perf.bench_kernels.cases``: ``(op, variant,
    config, fn)`` with a :class:`KernelCall` attached to ``fn``), same op, variant and config as the
    case's modelled row. A case that fails, or has no :class:`KernelCall`, is an error row.

    ``latency_us`` = the measured time of the launch (module docstring); ``extra``: ``kernel_us`` (the
    same), ``latency_is``, ``layer_scale``, ``timing_source`` and the timing's details, and with
    ``with_model`` the launch's modelled figures (``modelled_kernel_us``, ``modelled_bottleneck``, or
    ``modelled_error``) from :func:`modelled_launch_us`.
    """
    rows = []
    for op, variant, config, fn in cases:
        call = call_of(fn)
        name = f"{op}-{variant}"

        def measure(call: KernelCall | None = call, name: str = name) -> dict[str, Any]:
            if call is None:
                raise ValueError("the case has no KernelCall (perf.neuron_measure.attach_call)")
            t = timing(call, name)
            if not t.kernel_us > 0:
                raise ValueError(f"timing source returned kernel_us={t.kernel_us}; must be > 0")
            extra = {
                "kernel_us": t.kernel_us,
                "latency_is": "one launch as configured (not scaled to a layer)",
                "layer_scale": call.layer_scale,
                "modelled_layer_is": call.layer_is,
                "backend": "neuron",
                "cores": call.lnc,
                "timing_source": t.source,
                **dict(t.details),
            }
            if with_model:
                extra.update(_modelled_partner(call))
            return {"latency_us": t.kernel_us, "extra": extra}

        rows.append(run_case(measure, op=op, variant=variant, config=config, kind="measured"))
    return rows


def run_measure(
    cases: Sequence[tuple[str, str, Mapping[str, Any], Callable[[], Any]]],
    *,
    workdir: str | Path | None = None,
    timing: TimingSource | None = None,
    probe_result: Any = None,
) -> list[BenchRow]:
    """:func:`require_measure` first (raises :class:`NeuronUnavailable` before any case runs), then
    :func:`measure_rows` with ``timing`` (default :class:`ExplorerTiming` in ``workdir``, default a new
    temporary directory, kept: the rows name the NEFF/NTFF files)."""
    profiler = require_measure(probe_result)
    if timing is None:
        wd = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="nki-ardiff-measure-"))
        timing = ExplorerTiming(workdir=wd, profiler=profiler)
    return measure_rows(cases, timing)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "run-kernel":
        _run_kernel(sys.argv[2])
    else:
        raise SystemExit("usage: python -m perf.neuron_measure run-kernel CALL.pkl (used by --measure)")
