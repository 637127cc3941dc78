"""Self-test of the tolerance helpers (tests/numerics.py): a NaN or an unmatched inf is never within
tolerance, finite data inside the rule passes, finite data one step outside fails."""

from __future__ import annotations

import math

import pytest
import torch

from tests.numerics import FLOORS, abs_err, assert_within, max_abs_err, tolerance, worst_of

F32 = torch.float32


def _good() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(4, 33, generator=g)
    return ref + FLOORS[F32] / 4, ref  # inside the fp32 floor, ref_err = 0


def _with(t: torch.Tensor, value: float, where: tuple[int, int] = (2, 7)) -> torch.Tensor:
    t = t.clone()
    t[where] = value
    return t


def test_finite_good_data_passes_and_reports_its_error() -> None:
    out, ref = _good()
    err = assert_within(out, ref, F32, 0.0)
    assert err == pytest.approx(FLOORS[F32] / 4, rel=1e-6)
    # and just outside the tolerance fails: the check is not vacuous on finite data
    with pytest.raises(AssertionError, match="max abs error"):
        assert_within(ref + 2 * tolerance(F32, 0.0), ref, F32, 0.0)


@pytest.mark.parametrize(
    "case",
    ["nan_one", "all_nan", "inf_one", "neg_inf_one", "all_inf", "nan_in_ref", "nan_both", "inf_vs_neg_inf"],
)
def test_non_finite_output_fails(case: str) -> None:
    out, ref = _good()
    if case == "nan_one":
        out = _with(out, math.nan)
    elif case == "all_nan":
        out = torch.full_like(out, math.nan)
    elif case == "inf_one":
        out = _with(out, math.inf)
    elif case == "neg_inf_one":
        out = _with(out, -math.inf)
    elif case == "all_inf":
        out = torch.full_like(out, math.inf)
    elif case == "nan_in_ref":
        ref = _with(ref, math.nan)
    elif case == "nan_both":  # documented rule: NaN against NaN is still an infinite error
        out, ref = _with(out, math.nan), _with(ref, math.nan)
    elif case == "inf_vs_neg_inf":
        out, ref = _with(out, math.inf), _with(ref, -math.inf)
    assert max_abs_err(out, ref) == math.inf
    with pytest.raises(AssertionError, match="max abs error inf"):
        assert_within(out, ref, F32, 0.0)
    with pytest.raises(AssertionError):
        assert_within(out, ref, torch.bfloat16, 0.5)  # a generous tolerance does not help either


def test_matching_infinities_are_equal_and_do_not_mask_other_errors() -> None:
    out, ref = _good()
    out, ref = _with(out, -math.inf), _with(ref, -math.inf)  # e.g. lse of a fully masked row
    assert_within(out, ref, F32, 0.0)
    assert abs_err(out, ref)[2, 7].item() == 0.0
    with pytest.raises(AssertionError):
        assert_within(_with(out, 1.0, (0, 0)), ref, F32, 0.0)


def test_tuple_with_one_nan_member_fails() -> None:
    out, ref = _good()
    assert max_abs_err((out, _with(out, math.nan)), (ref, out)) == math.inf
    with pytest.raises(AssertionError):
        assert_within((out, torch.full_like(out, math.nan)), (ref, ref), F32, 0.0)


def test_worst_of_counts_nan_as_infinite() -> None:
    assert max(0.0, math.nan) == 0.0  # the hole this guards against
    assert worst_of(0.0, math.nan) == math.inf
    assert worst_of([1.0, math.nan, 2.0]) == math.inf
    assert worst_of(0.5, [0.25, 3.0], 1.0) == 3.0
    assert worst_of() == 0.0 and worst_of([]) == 0.0


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0])
def test_tolerance_rejects_non_finite_or_negative_reference_error(bad: float) -> None:
    with pytest.raises(ValueError, match="ref_err must be a finite non-negative number"):
        tolerance(F32, bad)


def test_nan_in_the_baseline_alone_is_an_infinite_elementwise_error() -> None:
    """abs_err itself (not only the fold in max_abs_err) marks a baseline NaN as inf, at that place only."""
    out, ref = _good()
    d = abs_err(out, _with(ref, math.nan))
    assert d[2, 7].item() == math.inf
    assert int(torch.isinf(d).sum()) == 1 and not bool(torch.isnan(d).any())
    assert d[0, 0].item() == pytest.approx(FLOORS[F32] / 4, rel=1e-6)  # elsewhere the finite error


@pytest.mark.parametrize(("n_actual", "n_expected"), [(1, 2), (2, 1), (0, 1), (1, 0)])
def test_tensor_count_mismatch_is_an_error_either_way(n_actual: int, n_expected: int) -> None:
    """(out,) against (out, lse) must not compare only the common prefix: lse would go unchecked."""
    out, ref = _good()
    lse = torch.full((4,), math.nan)  # would be an infinite error if it were compared
    actual, expected = (out, lse)[:n_actual], (ref, lse)[:n_expected]
    msg = f"got {n_actual} tensors, expected {n_expected}"
    with pytest.raises(ValueError, match=msg):
        max_abs_err(actual, expected)
    with pytest.raises(ValueError, match=msg):
        assert_within(actual, expected, F32, 0.0)
    assert max_abs_err((out, lse[:0]), (ref, lse[:0])) == pytest.approx(FLOORS[F32] / 4, rel=1e-6)


def test_tolerance_is_k_times_the_reference_error_plus_the_floor() -> None:
    """The documented rule with its documented constants (K = 2; floors 2**-19 fp32, 2**-7 bf16)."""
    assert tolerance(torch.bfloat16, 0.01) == 2 * 0.01 + 2.0**-7
    assert tolerance(F32, 3e-6) == 2 * 3e-6 + 2.0**-19
    assert tolerance(F32, 0.0) == 2.0**-19
    with pytest.raises(ValueError, match="has no recorded floor"):
        tolerance(torch.float16, 0.0)
