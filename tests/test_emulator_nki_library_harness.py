"""The nki-library harness (tools/nki_library_run.py) without a checkout: its per-family counting of
recorded cases (hand-counted rows), its refusal of a path that is not a checkout, and the ``neuron_dtypes``
stand-in's casts (round to nearest even, as ml_dtypes / numpy do)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from tools import nki_library_run as h
from tools.nki_library_shims import _compiler_modules, _make_neuron_dtypes, _make_simulator

ROWS = [
    {"id": "test/integration/nkilib/core/embeddings/test_rope.py::T::a[1]", "outcome": "passed"},
    {"id": "test/integration/nkilib/core/embeddings/test_rope.py::T::a[2]", "outcome": "skipped"},
    {"id": "test/integration/nkilib/core/embeddings/test_rope.py::T::a[3]", "outcome": "failed",
     "kind": "refused", "tag": "sbuf-capacity"},
    {"id": "test/integration/nkilib/core/mlp/test_mlp_cte.py::T::b[1]", "outcome": "failed",
     "kind": "mismatch"},
    {"id": "test/integration/nkilib/core/mlp/test_mlp_cte.py::T::b[2]", "outcome": "failed", "kind": "error"},
]  # fmt: skip


def test_summarize_counts_per_family():
    t = {r["family"]: r for r in h.summarize(ROWS)}
    assert set(t) == {"core/embeddings/rope", "core/mlp/mlp_cte"}
    rope, mlp = t["core/embeddings/rope"], t["core/mlp/mlp_cte"]
    cols = ("cases", "skipped", "run", "unchanged", "matched", "refused")
    assert tuple(rope[c] for c in cols) == (3, 1, 2, 1, 1, 1)
    assert rope["refused_by"] == {"sbuf-capacity": 1}
    assert (mlp["run"], mlp["unchanged"], mlp["matched"], mlp["mismatch"], mlp["error"]) == (2, 1, 0, 1, 1)
    text = h.format_table(h.summarize(ROWS))
    assert "| **total** | 5 | 1 | 4 | 2 | 1 | 1 | 1 | 1 | |" in text


def test_not_a_checkout_is_refused(tmp_path):
    with pytest.raises(SystemExit):
        h.main([str(tmp_path)])


def test_neuron_dtypes_stand_in_rounds_to_nearest_even():
    nd = _make_neuron_dtypes()
    x = np.array([1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, -2.5], np.float32)  # ties at bf16
    got = nd.static_cast(x, nd.bfloat16)
    np.testing.assert_array_equal(got.astype(np.float32), np.array([1.0, 1.0 + 2.0**-6, -2.5], np.float32))
    assert got.dtype == np.dtype(ml_dtypes.bfloat16)
    assert (
        nd.sizeinbytes(nd.bfloat16) == 2 and nd.is_float_type(nd.bfloat16) and not nd.is_float_type(np.int32)
    )
    np.testing.assert_array_equal(
        nd.static_cast(np.array([2.7, -2.7]), np.int32), np.array([2, -2], np.int32)
    )


class _Report:
    """The two attributes of a pytest report that ``_classify`` reads."""

    def __init__(self, crash: str) -> None:
        self.longrepr = type(
            "R", (), {"reprcrash": type("C", (), {"message": crash})(), "__str__": lambda s: crash}
        )()


def test_classify_validation_failure_is_a_mismatch_and_a_missed_expected_error_is_not():
    out = h._classify(_Report("test.utils.exceptions.ValidationException: Validation failed for ['out']"))
    assert out["kind"] == "mismatch"
    missed = "AssertionError: Regex pattern did not match.\n  Expected regex: 'size mismatch'\n  Actual: 'x'"
    assert h._classify(_Report(missed))["kind"] == "error"
    refused = "nki_kernels.emulator.errors.SbufCapacityError: [sbuf-capacity] too big"
    assert h._classify(_Report(refused)) == {"kind": "refused", "tag": "sbuf-capacity", "message": refused}


def test_compiler_package_names_resolve_to_the_stand_ins():
    """Built without installing (install() would alias ``nki`` for the whole test session)."""
    typing_mod = _make_simulator()["nki_cpu_simulator.nki.typing"]
    mods = _compiler_modules(typing_mod, _make_neuron_dtypes())
    nt = mods["neuronxcc.nki.typing"]
    assert isinstance(nt.mutable_tensor, type) and isinstance(nt.tensor, type)
    assert mods["neuronxcc"].nki.typing is nt
    static_cast = mods["neuronxcc"].starfish.support.dtype.static_cast
    got = static_cast(np.array([1.0 + 2.0**-8], np.float32), ml_dtypes.bfloat16)
    assert got.astype(np.float32)[0] == 1.0  # the tie rounds to even
