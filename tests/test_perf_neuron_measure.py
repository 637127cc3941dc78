"""The measured-latency path (perf/neuron_measure.py, ``bench kernels --backend neuron --measure``) and the
device probe (nki_kernels/neuron_probe.py), without a device: the early error, the documented command
sequence (with a fake runner), the row schema (with a fake timing source) and the ingestion into
calibration points. The device itself is exercised only by the ``neuron`` tier (tests/test_neuron_*.py).
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from nki_ardiff.cli import app
from nki_kernels.emulator import TensorSpec
from nki_kernels.emulator import run as emu_run
from nki_kernels.emulator.cost import profile
from nki_kernels.neuron_probe import NeuronProbe, probe
from perf import bench_kernels, neuron_measure
from perf.neuron_measure import (
    ExplorerTiming,
    KernelCall,
    NeuronUnavailable,
    Timing,
    call_of,
    measure_rows,
    parse_total_time_s,
    require_measure,
    run_measure,
)
from perf.neuron_points import CalibrationPoint, calibration_points, points_from_results
from perf.runner import BenchRow, append_rows, read_rows, run_case

FULL = NeuronProbe(devices=("/dev/neuron0",), nki_version="0.6.0", nki_error="", torch_xla_error="",
                   profiler="/opt/aws/neuron/bin/neuron-explorer")  # fmt: skip
EMPTY = NeuronProbe(
    devices=(),
    nki_version="",
    nki_error="ModuleNotFoundError: No module named 'nki'",
    torch_xla_error="ModuleNotFoundError: No module named 'torch_xla'",
    profiler="",
)


# ---- probe ---------------------------------------------------------------------------------------


def test_probe_reasons_name_each_missing_piece() -> None:
    assert FULL.reason(("device", "nki", "torch_xla", "profiler")) == ""
    parts = EMPTY.missing(("device", "nki", "torch_xla", "profiler"))
    assert len(parts) == 4
    assert "no Neuron device" in parts[0] and "/dev/neuron*" in parts[0]
    assert "No module named 'nki'" in parts[1]
    assert "torch_xla" in parts[2]
    assert "neuron-explorer" in parts[3]
    assert EMPTY.reason(("profiler",)) == parts[3]  # only what is asked for
    with pytest.raises(ValueError, match="unknown requirement"):
        FULL.missing(("gpu",))


def test_probe_finds_device_nodes_and_honours_forced_emulator(tmp_path: Path, monkeypatch) -> None:
    assert probe(str(tmp_path / "neuron*")).devices == ()
    (tmp_path / "neuron0").touch()
    (tmp_path / "neuron1").touch()
    found = probe(str(tmp_path / "neuron*"))
    assert found.devices == (str(tmp_path / "neuron0"), str(tmp_path / "neuron1"))
    monkeypatch.setenv("NKI_ARDIFF_BACKEND", "emulator")
    forced = probe(str(tmp_path / "neuron*"))
    assert forced.nki_version == "" and "NKI_ARDIFF_BACKEND=emulator" in forced.reason(("nki",))


def test_tier_skips_with_reason_or_sets_lnc1(monkeypatch) -> None:
    import types

    from tests import neuron_helpers

    monkeypatch.setattr(neuron_helpers, "probe", lambda: EMPTY)
    with pytest.raises(pytest.skip.Exception, match=r"^neuron tier not run: no Neuron device"):
        neuron_helpers.device_or_skip()
    # a host with everything: the fixture hands out torch_xla's device with the runtime at LNC=1
    monkeypatch.setattr(neuron_helpers, "probe", lambda: FULL)
    monkeypatch.setitem(sys.modules, "torch_xla", types.SimpleNamespace(device=lambda: "xla:0"))
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)
    assert neuron_helpers.device_or_skip() == "xla:0" and os.environ["NEURON_LOGICAL_NC_CONFIG"] == "1"
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")  # trn2's default: the lnc=1 launches would not run
    with pytest.raises(pytest.fail.Exception, match="NEURON_LOGICAL_NC_CONFIG=2"):
        neuron_helpers.device_or_skip()


# ---- the early error -----------------------------------------------------------------------------


def test_require_measure_lists_what_is_missing() -> None:
    with pytest.raises(NeuronUnavailable) as info:
        require_measure(EMPTY)
    msg = str(info.value)
    assert (
        "cannot run here" in msg and "no Neuron device" in msg and "nki" in msg and "neuron-explorer" in msg
    )
    assert "torch_xla" not in msg  # the measure path launches with numpy arrays, no framework
    assert require_measure(FULL) == FULL.profiler


def test_run_measure_fails_before_any_case() -> None:
    calls: list[Any] = []
    with pytest.raises(NeuronUnavailable):
        run_measure(
            bench_kernels.cases(bench_kernels.QUICK), timing=lambda c, n: calls.append(n), probe_result=EMPTY
        )  # type: ignore[arg-type,func-returns-value]
    assert calls == []


def test_cli_measure_without_device_is_a_clear_error_not_a_traceback(monkeypatch) -> None:
    import nki_kernels.neuron_probe

    monkeypatch.setattr(nki_kernels.neuron_probe, "probe", lambda: EMPTY)  # as on any host without a device
    r = CliRunner().invoke(
        app, ["bench", "kernels", "--backend", "neuron", "--measure", "--quick", "--no-save"]
    )
    assert r.exit_code == 2, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)
    assert "--measure times the kernels on a Neuron device and cannot run here" in r.output
    assert "Traceback" not in r.output
    r = CliRunner().invoke(app, ["bench", "kernels", "--measure", "--quick", "--no-save"])
    assert r.exit_code == 2 and "--measure and --backend neuron go together" in r.output


def test_module_measure_exit_status() -> None:
    # NKI_ARDIFF_BACKEND=emulator makes the real nki count as absent, on any host
    env = {**os.environ, "NKI_ARDIFF_BACKEND": "emulator"}
    r = subprocess.run([sys.executable, "-m", "perf.bench_kernels", "--backend", "neuron", "--measure"],
                       capture_output=True, text=True, timeout=120, env=env)  # fmt: skip
    assert r.returncode == 2 and r.stderr.startswith("error: --measure") and "Traceback" not in r.stderr
    assert "NKI_ARDIFF_BACKEND=emulator forces the bundled emulator" in r.stderr


# ---- the CLI exit-code fix -----------------------------------------------------------------------


def test_cli_bench_kernels_returns_rows_and_exits_zero() -> None:
    # was: TypeError int() of list (the bench's rows were taken as an exit code)
    r = CliRunner().invoke(app, ["bench", "kernels", "--quick", "--no-save"])
    assert r.exit_code == 0 and r.exception is None, r.output
    assert "modelled rope3d/sbuf_deinterleave_lnc1" in r.output


@pytest.mark.parametrize(("result", "code"), [([1, 2], 0), (None, 0), (0, 0), (3, 3), (True, 0)])
def test_cli_bench_main_result_to_exit_code(monkeypatch, result: Any, code: int) -> None:
    import importlib
    import types

    real = importlib.import_module
    fake = types.SimpleNamespace(main=lambda argv: result)
    monkeypatch.setattr(
        importlib, "import_module", lambda n, *a, **k: fake if n == "perf.e2e" else real(n, *a, **k)
    )
    r = CliRunner().invoke(app, ["bench", "e2e"])
    assert r.exit_code == code, r.output


# ---- rows from a fake timing source --------------------------------------------------------------


class FakeTiming:
    """Kernel time 10, 20, 30 ... us in case order; records the calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[KernelCall, str]] = []

    def __call__(self, call: KernelCall, name: str) -> Timing:
        self.calls.append((call, name))
        return Timing(10.0 * len(self.calls), "fake", {"neff": f"/x/{name}.neff"})


def test_measured_rows_schema_and_scaling(tmp_path: Path) -> None:
    shapes = bench_kernels.QUICK
    cases = bench_kernels.cases(shapes)
    fake = FakeTiming()
    rows = measure_rows(cases, fake)
    assert len(rows) == len(cases) == len(fake.calls)
    modelled = [run_case(fn, op=op, variant=v, config=c, kind="modelled") for op, v, c, fn in cases]
    for i, (row, mod, (op, variant, config, fn)) in enumerate(zip(rows, modelled, cases)):
        assert isinstance(row, BenchRow) and row.kind == "measured" and row.status == "ok", row.message
        assert (row.op, row.variant, dict(row.config)) == (op, variant, dict(config))
        call = call_of(fn)
        assert call is not None and fake.calls[i] == (call, f"{op}-{variant}")
        kernel_us = 10.0 * (i + 1)
        assert row.extra["kernel_us"] == kernel_us and row.extra["neff"] == f"/x/{op}-{variant}.neff"
        # the row is the launch as configured, beside the cost model's figure for the same launch
        assert row.latency_us == kernel_us and row.extra["cores"] == call.lnc
        if not op.startswith("attention"):  # these modelled rows report the launch itself
            assert row.extra["modelled_kernel_us"] == pytest.approx(mod.latency_us)
            assert row.extra["modelled_bottleneck"] == mod.extra["bottleneck"] and call.layer_scale == 1
        else:  # modelled rows report a layer; the partner is the traced launch, recomputed here
            _, tr = emu_run(call.kernel, *call.args, lnc=call.lnc, trace_only=True, keep_events=True)
            assert row.extra["modelled_kernel_us"] == pytest.approx(
                profile(tr, cores=call.lnc).latency_ns / 1e3
            )
    att = next(r for r in rows if r.variant == "flash_fused_lnc2")
    # 2 traced heads on 2 cores (1 per core); the modelled row reaches a layer of H heads on 2 cores
    assert att.extra["layer_scale"] == shapes.heads / 2
    pc = next(r for r in rows if r.variant == "per_core_tp4xsp2")
    assert pc.extra["layer_scale"] == 1  # all H/4 heads of the core's share are in the launch
    # round trip through the results file
    path = append_rows(rows, tmp_path / "m.jsonl")
    assert [r.as_dict() for r in read_rows(path)] == [r.as_dict() for r in rows]


def test_failed_timing_and_missing_call_are_error_rows() -> None:
    def boom(call: KernelCall, name: str) -> Timing:
        raise RuntimeError("capture failed (exit 1)")

    case = bench_kernels.cases(bench_kernels.QUICK)[0]
    bare = ("rope3d", "bare", {"L": 1}, lambda: {"latency_us": 1.0})
    rows = measure_rows([case, bare], boom, with_model=False)
    assert [r.status for r in rows] == ["error", "error"]
    assert "capture failed" in rows[0].message and "no KernelCall" in rows[1].message
    zero = measure_rows([case], lambda c, n: Timing(0.0, "fake"), with_model=False)
    assert zero[0].status == "error" and "kernel_us=0.0" in zero[0].message


# ---- the documented route with a fake runner -----------------------------------------------------


class FakeRunner:
    """Stands in for subprocess.run: the child writes a NEFF, capture an NTFF, view prints a summary."""

    def __init__(self, summary: str, neff: bool = True, fail: str = "") -> None:
        self.summary, self.neff, self.fail = summary, neff, fail
        self.cmds: list[tuple[list[str], Path, dict | None]] = []

    def __call__(self, cmd, cwd, env, capture_output, text, check):  # noqa: ARG002
        self.cmds.append((list(cmd), Path(cwd), env))
        step = "child" if cmd[1:3] == ["-m", "perf.neuron_measure"] else cmd[1]
        if step == self.fail:
            return subprocess.CompletedProcess(cmd, 1, "", "NRT: device busy")
        if step == "child" and self.neff:
            (Path(cwd) / "file.neff").write_bytes(b"neff")
        if step == "capture":
            (Path(cwd) / "profile_exec_2.ntff").write_bytes(b"ntff")
        return subprocess.CompletedProcess(cmd, 0, self.summary if step == "view" else "", "")


def _call() -> KernelCall:
    from nki_kernels.rope3d import rope3d_kernel

    specs = (TensorSpec((1, 96, 2, 64), "bfloat16"), TensorSpec((1, 96, 2, 64), "bfloat16"),
             TensorSpec((96, 32), "float32"), TensorSpec((96, 32), "float32"))  # fmt: skip
    return KernelCall(rope3d_kernel, specs, lnc=2)


def test_explorer_timing_runs_the_documented_commands(tmp_path: Path) -> None:
    fake = FakeRunner(json.dumps({"summary": [{"event_count": 3, "total_time": 1.75e-05}]}))
    t = ExplorerTiming(tmp_path, "neuron-explorer", runner=fake, python="py")(_call(), "rope3d-x")
    assert t.kernel_us == pytest.approx(17.5)
    case = tmp_path / "rope3d-x"
    (child, cwd, env), (capture, _, _), (view, _, _) = fake.cmds
    assert child == ["py", "-m", "perf.neuron_measure", "run-kernel", str(case / "call.pkl")] and cwd == case
    assert env is not None and env["NEURON_FRAMEWORK_DEBUG"] == "1" and env["NEURON_LOGICAL_NC_CONFIG"] == "2"
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(
        Path(neuron_measure.__file__).resolve().parent.parent
    )
    assert capture == ["neuron-explorer", "capture", "-n", str(case / "file.neff"), "-s",
                       str(case / "profile.ntff"), "--profile-nth-exec=2"]  # fmt: skip
    assert view == ["neuron-explorer", "view", "-n", str(case / "file.neff"), "-s",
                    str(case / "profile_exec_2.ntff"), "--output-format", "summary-json"]  # fmt: skip
    ref, args, lnc = pickle.loads((case / "call.pkl").read_bytes())
    assert ref == "nki_kernels.rope3d:rope3d_kernel" and lnc == 2 and args == _call().args
    assert t.details["neff"] == str(case / "file.neff") and t.details["total_time_s"] == 1.75e-05


def test_explorer_timing_failures_say_which_step(tmp_path: Path) -> None:
    ok = json.dumps({"total_time": 1e-5})
    with pytest.raises(RuntimeError, match="no .neff .*NEURON_FRAMEWORK_DEBUG=1"):
        ExplorerTiming(tmp_path, "neuron-explorer", runner=FakeRunner(ok, neff=False))(_call(), "a")
    with pytest.raises(RuntimeError, match=r"capture failed \(exit 1\).*device busy"):
        ExplorerTiming(tmp_path, "neuron-explorer", runner=FakeRunner(ok, fail="capture"))(_call(), "b")


def test_parse_total_time() -> None:
    assert parse_total_time_s('{"total_time": 0.017}') == 0.017
    assert parse_total_time_s('[{"nc_idx": 1, "x": {"total_time": "2.5e-05"}}]') == 2.5e-05
    for bad, msg in (("total_time 0.017", "not JSON"), ('{"summary": {}}', "no total_time"),
                     ('{"total_time": 0}', "must be > 0")):  # fmt: skip
        with pytest.raises(ValueError, match=msg):
            parse_total_time_s(bad)


def test_child_inputs_are_zero_arrays_of_the_specs() -> None:
    args = (
        TensorSpec((2, 3), "bfloat16"),
        [TensorSpec((4,), "float32")],
        TensorSpec((1, 1), "int32"),
        0.5,
        ((0, 1),),
    )
    q, srcs, slot, scale, segs = neuron_measure._zeros(args)
    assert q.shape == (2, 3) and q.dtype.name == "bfloat16" and not np.any(q.astype(np.float32))
    assert isinstance(srcs, list) and srcs[0].dtype == np.float32 and srcs[0].shape == (4,)
    assert slot.dtype == np.int32 and scale == 0.5 and segs == ((0, 1),)


# ---- ingestion -----------------------------------------------------------------------------------


def _mrow(op: str = "attention", variant: str = "v", lat: float = 50.0, **extra: Any) -> BenchRow:
    ex = {"kernel_us": lat, "latency_is": "one launch", "timing_source": "fake", **extra}
    return BenchRow(op=op, variant=variant, config={"L": 8}, kind="measured", latency_us=lat, extra=ex)


def test_calibration_points_from_the_recorded_partner() -> None:
    (p,) = calibration_points([_mrow(modelled_kernel_us=40.0, modelled_bottleneck="dma")])
    assert isinstance(p, CalibrationPoint)
    assert (p.measured_lo_us, p.measured_hi_us, p.modelled_us, p.bottleneck) == (50.0, 50.0, 40.0, "dma")
    assert p.ratio == pytest.approx(0.8) and p.measured_us == pytest.approx(50.0) and p.group == "N"
    assert p.name == "neuron:attention/v" and json.loads(p.shape) == {"L": 8} and p.method == "latency"
    assert p.quantity == "one launch" and not p.in_range


def test_calibration_points_remodel_with_another_model() -> None:
    cases = bench_kernels.cases(bench_kernels.QUICK)
    rows = measure_rows(cases[:3], FakeTiming(), with_model=False)
    seen: list[int] = []

    def model(trace: Any, cores: int) -> tuple[float, str]:  # a stand-in cost model: 1 us per record
        seen.append(cores)
        return 1e3 * sum(n for _, n in trace.entries()), "fake"

    pts = calibration_points(rows, remodel=cases, model=model)
    for p, r, (_, _, _, fn) in zip(pts, rows, cases):
        call = call_of(fn)
        assert call is not None
        _, tr = emu_run(call.kernel, *call.args, lnc=call.lnc, trace_only=True)
        assert p.modelled_us == pytest.approx(sum(n for _, n in tr.entries())) and p.bottleneck == "fake"
        assert p.ratio == pytest.approx(p.modelled_us / r.latency_us)
    assert seen == [call_of(fn).lnc for _, _, _, fn in cases[:3]]  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="no case with this op, variant and config"):
        calibration_points([_mrow()], remodel=cases)


def test_calibration_points_never_drop_a_row_silently() -> None:
    err = BenchRow(op="attention", variant="v", config={}, kind="measured", status="error", message="NRT")
    with pytest.raises(ValueError, match="no measurement.*NRT"):
        calibration_points([err])
    with pytest.raises(ValueError, match="no modelled figure"):
        calibration_points([_mrow()])
    with pytest.raises(ValueError, match="no modelled figure .*RuntimeError: boom"):
        calibration_points([_mrow(modelled_error="RuntimeError: boom")])
    with pytest.raises(ValueError, match="expected 'measured'"):
        calibration_points([BenchRow(op="a", variant="v", config={}, kind="modelled", latency_us=1.0)])


def test_points_from_results_files(tmp_path: Path) -> None:
    rows = measure_rows(bench_kernels.cases(bench_kernels.QUICK)[:2], FakeTiming())
    path = append_rows(rows, tmp_path / "bench_kernels_quick_measured.jsonl")
    pts = points_from_results(path)
    assert [p.name for p in pts] == [f"neuron:{r.op}/{r.variant}" for r in rows]
    for p, r in zip(pts, rows):
        assert p.measured_lo_us == r.latency_us and p.modelled_us == r.extra["modelled_kernel_us"]
        assert p.ratio == pytest.approx(r.extra["modelled_kernel_us"] / r.latency_us)
        assert p.source_url == str(path)
    # re-modelled now from the bench's cases (the same code here, so the same figures)
    again = points_from_results(path, remodel=True)
    assert [p.modelled_us for p in again] == pytest.approx([p.modelled_us for p in pts])


def test_points_are_the_calibration_suites_rows() -> None:
    from perf.calibration import harness

    (p,) = calibration_points([_mrow(modelled_kernel_us=75.0)])
    assert isinstance(p, harness.CalibrationRow) and p.method == "latency" and p.group == "N"
    assert p.ratio == pytest.approx(p.modelled_us / p.measured_lo_us) and p.in_range is False
    assert harness.geo_stats([p.ratio]) == pytest.approx((1.5, 1.0))


def _child_runs(monkeypatch, tmp_path: Path, which) -> list[str]:
    """The child's half (``run-kernel``: unpickle, zero inputs, launch) for bench cases, with the emulator
    standing in for the real nki (the shim is told it is ``"nki"``)."""
    from nki_kernels import _nki

    monkeypatch.setattr(_nki, "backend_name", lambda: "nki")
    done = []
    for op, variant, _, fn in bench_kernels.cases(bench_kernels.QUICK):
        call = call_of(fn)
        if not which(op) or call is None:
            continue
        spec = tmp_path / f"{op}-{variant}.pkl"
        spec.write_bytes(pickle.dumps((call.kernel_ref(), call.args, call.lnc)))
        neuron_measure._run_kernel(str(spec))
        done.append(f"{op}/{variant}")
    return done


def test_child_launches_rope_and_kv_cases(monkeypatch, tmp_path: Path) -> None:
    done = _child_runs(monkeypatch, tmp_path, lambda op: op.startswith(("rope3d", "kv_cache")))
    want = [f"{op}/{v}" for op, v, _, fn in bench_kernels.cases(bench_kernels.QUICK)
            if op.startswith(("rope3d", "kv_cache")) and call_of(fn) is not None]  # fmt: skip
    assert done == want and len(done) >= 7 and "kv_cache_write/ring_lnc2" in done


@pytest.mark.slow
def test_child_launches_every_case(monkeypatch, tmp_path: Path) -> None:
    done = _child_runs(monkeypatch, tmp_path, lambda op: True)
    assert len(done) == len(bench_kernels.cases(bench_kernels.QUICK))


def test_child_refuses_without_real_nki(tmp_path: Path, monkeypatch) -> None:
    from nki_kernels import _nki

    monkeypatch.setattr(_nki, "backend_name", lambda: "emulator")
    spec = tmp_path / "c.pkl"
    spec.write_bytes(pickle.dumps((_call().kernel_ref(), _call().args, 1)))
    with pytest.raises(SystemExit, match="real nki package is not importable"):
        neuron_measure._run_kernel(str(spec))
