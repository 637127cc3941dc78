"""Closing the calibration loop without a device: a synthetic trn2 whose launch times are the cost model's
at a known parameter set is "measured" through the device path (``perf.neuron_points.measure_calibration``:
the calibration kernels as ``KernelCall`` launches, each point's figure by its own method), its rows go
through a JSONL file back into calibration points (``device_points_from_file``), and the re-fit
(``perf.calibration.refit.trn2_fitter``) must recover the known parameters.

Tolerance: the synthetic device is noise-free and prices exactly what the fit prices, so the only error is
the fit's stopping rule (Levenberg-Marquardt steps below ``rtol = 1 %`` of a knob's scaled span stop it);
every recovered value must lie within 2 % of the known one (the ScalarE/VectorE cycle counts, fitted on
a linear scale of span 400 cycles, within 2 % or 4 cycles).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest

from nki_kernels.emulator import run as emu_run
from nki_kernels.emulator.cost import Trn2CostParams, profile
from perf.calibration.points import POINTS
from perf.calibration.refit import TRN2_KNOBS, trn2_fitter, with_queued_rate
from perf.neuron_measure import KernelCall, Timing
from perf.neuron_points import (
    CALIBRATION_OP,
    calibration_call,
    device_points,
    device_points_from_file,
    measure_calibration,
)
from perf.runner import append_rows

BY_NAME = {p.name: p for p in POINTS}
LOOP_POINTS = (
    "fixed_idle", "dma_issue", "pe_transpose_fp32", "evict_scalar", "evict_vector", "matmul_b2b",
    "dma_1K", "dma_4K",
)  # fmt: skip
LOOP_KNOBS = (
    "kernel_fixed_ns", "dma_issue_ns", "transpose_fp32_factor", "scalar_psum_access_cycles",
    "vector_psum_access_cycles", "matmul_overhead_cycles", "queued_gbps@1024", "queued_gbps@4096",
)  # fmt: skip


def true_params() -> Trn2CostParams:
    """The synthetic device's parameters: every looped knob moved away from the model's default."""
    p = dataclasses.replace(
        Trn2CostParams(),
        kernel_fixed_ns=11_500.0,
        dma_issue_ns=420.0,
        transpose_fp32_factor=3.5,
        scalar_psum_access_cycles=110,
        vector_psum_access_cycles=170,
        matmul_overhead_cycles=20,
    )
    return with_queued_rate(with_queued_rate(p, 1024, 230.0), 4096, 330.0)


class SyntheticDevice:
    """A fake trn2: the time of a launch is the cost model's latency (schedule, event log) of its trace
    at ``params``; ``launches`` records every call it timed."""

    def __init__(self, params: Any) -> None:
        self.params = params
        self.launches: list[tuple[str, KernelCall]] = []

    def __call__(self, call: KernelCall, name: str) -> Timing:
        self.launches.append((name, call))
        _, trace = emu_run(call.kernel, *call.args, lnc=call.lnc, trace_only=True, keep_events=True,
                           **dict(call.kwargs))  # fmt: skip
        return Timing(profile(trace, self.params).latency_ns / 1e3, "synthetic device (cost model)")


def test_calibration_call_is_the_harness_run() -> None:
    """The device launch of a run traces to the very trace the harness prices (same instructions)."""
    from perf.calibration.harness import capture_trace

    run = BY_NAME["evict_scalar"].runs[0]
    call = calibration_call(run)
    assert call.lnc == 1 and dict(call.kwargs) == {"engine": "scalar", "reps": 256}
    _, trace = emu_run(call.kernel, *call.args, trace_only=True, keep_events=True, **dict(call.kwargs))
    ref = capture_trace(run, keep_events=True)
    assert trace.counts == ref.counts and max(trace.counts.values()) == 256  # one copy per rep
    assert [rec for rec, _, _ in trace.iter_events()] == [rec for rec, _, _ in ref.iter_events()]


def test_measure_rows_roundtrip_and_refit_recovers_the_device(tmp_path: Path) -> None:
    truth = true_params()
    device = SyntheticDevice(truth)
    points = [BY_NAME[n] for n in LOOP_POINTS]
    rows = measure_calibration(points, device)
    assert [r.status for r in rows] == ["ok"] * len(points), [r.message for r in rows]
    assert {r.op for r in rows} == {CALIBRATION_OP} and [r.variant for r in rows] == list(LOOP_POINTS)
    assert len(device.launches) == sum(len(p.runs) for p in points)
    # a row's figure is the point's method over the device's run times (dma_issue: slope per DMA pair)
    issue = rows[LOOP_POINTS.index("dma_issue")]
    (ta, tb), (ca, cb) = issue.extra["run_kernel_us"], issue.extra["run_counts"]
    assert issue.latency_us == pytest.approx((tb - ta) / (cb - ca) * BY_NAME["dma_issue"].units)
    path = append_rows(rows, tmp_path / "calibration_measured.jsonl")
    dev = device_points_from_file(path)
    assert [p.name for p in dev] == list(LOOP_POINTS)
    for p, r in zip(dev, rows, strict=True):
        assert p.measured_us == (r.latency_us, r.latency_us) and p.dge_mode is None
        assert p.source.repo.startswith("device:") and p.source.url == str(path)
        assert p.runs == BY_NAME[p.name].runs
    knobs = [k for k in TRN2_KNOBS if k.name in LOOP_KNOBS]
    assert len(knobs) == len(LOOP_KNOBS)
    fitter = trn2_fitter(dev, keep_events=True, knobs=knobs)
    start = Trn2CostParams()
    res = fitter.fit(start, method="lm")
    assert not res.unpinned
    for k in knobs:
        want, got = float(k.get(truth)), res.values[k.name]
        assert float(k.get(start)) != pytest.approx(want, rel=0.02), k.name  # the fit had to move it
        tol = 4.0 if k.name.endswith("psum_access_cycles") else 0.0
        assert abs(got - want) <= max(0.02 * want, tol), f"{k.name}: re-fit {got:.4g}, device {want:.4g}"
    assert all(abs(math.log(r)) < 0.02 for r in res.ratios.values()), res.ratios


def test_device_rows_bad_input_is_refused() -> None:
    p = BY_NAME["dma_issue"]
    flat = measure_calibration([p], lambda call, name: Timing(20.0, "flat"))  # slope 0: within the noise
    assert flat[0].status == "error" and "slope" in flat[0].message and "re-measure" in flat[0].message
    with pytest.raises(ValueError, match="no measurement"):
        device_points(flat)
    ok = measure_calibration([p], SyntheticDevice(Trn2CostParams()))
    with pytest.raises(ValueError, match="given twice"):
        device_points(ok + ok)
    with pytest.raises(ValueError, match="no calibration point named"):
        device_points([dataclasses.replace(ok[0], variant="nope")])
    with pytest.raises(ValueError, match="method"):
        device_points([dataclasses.replace(ok[0], extra={**ok[0].extra, "method": "latency"})])
    with pytest.raises(ValueError, match="kind='measured'"):
        device_points([dataclasses.replace(ok[0], kind="modelled")])


def test_calibration_cli_reads_device_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m perf.calibration --measured FILE --refit`` prices the device points and re-fits."""
    from perf.calibration.__main__ import main

    truth = dataclasses.replace(Trn2CostParams(), dma_issue_ns=420.0)
    rows = measure_calibration([BY_NAME["dma_issue"]], SyntheticDevice(truth))
    path = append_rows(rows, tmp_path / "m.jsonl")
    assert main(["--measured", str(path), "--refit"]) == 0
    out = capsys.readouterr().out
    assert f"measured = DEVICE measurement ({path})" in out
    line = next(x for x in out.splitlines() if x.startswith("| dma_issue_ns |"))
    assert float(line.split("|")[3]) == pytest.approx(420.0, rel=0.02)


def test_device_route_carries_a_calibration_runs_kwargs(tmp_path: Path, monkeypatch) -> None:
    """The documented route (``ExplorerTiming``) for a calibration run: the pickled call carries the
    run's keyword arguments, and the child wraps the plain calibration kernel in ``nki.jit`` and launches
    it with them (the emulator standing in for the real nki: the shim is told it is ``"nki"``)."""
    import json
    import pickle
    import subprocess

    from nki_kernels import _nki
    from perf import neuron_measure
    from perf.neuron_measure import ExplorerTiming

    launched: list[dict[str, Any]] = []
    real_launch = _nki.launch

    def spy(kernel: Any, *args: Any, lnc: int = 1, **kwargs: Any) -> Any:
        launched.append({"kernel": kernel, "lnc": lnc, **kwargs})
        return real_launch(kernel, *args, lnc=lnc, **kwargs)

    monkeypatch.setattr(_nki, "backend_name", lambda: "nki")
    monkeypatch.setattr(_nki, "launch", spy)

    def runner(cmd, cwd, env, capture_output, text, check):  # noqa: ARG001
        if cmd[1:3] == ["-m", "perf.neuron_measure"]:
            neuron_measure._run_kernel(cmd[-1])  # the child's half, in this process
            (Path(cwd) / "k.neff").write_bytes(b"neff")
        if cmd[1] == "capture":
            (Path(cwd) / "profile_exec_2.ntff").write_bytes(b"ntff")
        out = json.dumps({"total_time": 2.5e-5}) if cmd[1] == "view" else ""
        return subprocess.CompletedProcess(cmd, 0, out, "")

    run = BY_NAME["dma_1K"].runs[1]
    t = ExplorerTiming(tmp_path, "neuron-explorer", runner=runner)(calibration_call(run), "dma_1K-1")
    assert t.kernel_us == pytest.approx(25.0)
    ref, args, lnc, kwargs = pickle.loads((tmp_path / "dma_1K-1" / "call.pkl").read_bytes())
    assert ref == "perf.calibration.kernels_small:dma_pattern_kernel" and lnc == 1
    assert dict(kwargs) == dict(run.kwargs) and dict(kwargs)["reps"] == 16
    (got,) = launched
    assert isinstance(got["kernel"], _nki.LazyKernel) and got["reps"] == 16 and got["lnc"] == 1
    assert got["pattern"] == dict(run.kwargs)["pattern"]
