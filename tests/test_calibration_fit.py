"""Tests of perf.calibration.fit on a synthetic model whose true parameters are known (fast, no emulator).

The synthetic model: parameters ``a, b, c, d`` (a frozen dataclass); each point's modelled figure is a
closed-form function of some of them; "published" figures are the model at the true parameters (or, for
the inconsistent-source cases, stated per point).  Expected values are derived by hand in each test.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pytest

from perf.calibration.fit import Fitter, Knob, geo_summary, leave_one_source_out


@dataclass(frozen=True)
class Toy:
    a: float = 1.0
    b: float = 1.0
    c: float = 1.0
    d: float = 1.0


TRUE = Toy(a=2.0, b=0.5, c=3.0, d=1.5)

# figure(point, params): which parameters each point depends on is part of the expected facts below
FIGURES = {
    "p1": lambda p: 1.0 + p.a,  # a
    "p2": lambda p: p.a * p.c,  # a, c
    "p3": lambda p: p.c + 2.0 * p.a,  # a, c
    "p4": lambda p: p.b + 1.0,  # b
    "p5": lambda p: p.d * 4.0,  # d
    "p6": lambda p: max(p.b, 1.0) + p.c,  # b only above 1 (kink), c
}
SOURCES = {"S1": ("p1", "p2"), "S2": ("p3", "p4", "p6"), "S3": ("p5",)}
POINTS = tuple(FIGURES)


def _knob(name: str, prior: float, **kw: object) -> Knob:
    return Knob(
        name=name,
        get=lambda p: getattr(p, name),
        put=lambda p, v: replace(p, **{name: v}),
        bounds=(0.1, 10.0),
        prior=prior,
        **kw,  # type: ignore[arg-type]
    )


KNOBS = (_knob("a", 1.0), _knob("b", 1.0), _knob("c", 1.0), _knob("d", 0.8))


def _predictor(measured: dict[str, float], calls: list[tuple[str, ...]] | None = None):
    def predict(params: Toy, names):
        if calls is not None:
            calls.append(tuple(names))
        return {n: FIGURES[n](params) / measured[n] for n in names}

    return predict


MEASURED = {n: f(TRUE) for n, f in FIGURES.items()}
START = Toy(a=1.0, b=2.0, c=1.0, d=1.0)


def _fitter(measured: dict[str, float] = MEASURED, **kw: int) -> Fitter:
    return Fitter(KNOBS, _predictor(measured), POINTS, grid=kw.get("grid", 9), refine=kw.get("refine", 30))


def test_sensitivity_finds_each_points_knobs_including_a_one_sided_kink() -> None:
    f = _fitter()
    movers = f.sensitivity(START)
    names = {n: {KNOBS[i].name for i in idx} for n, idx in movers.items()}
    # p6 = max(b, 1) + c: at b = 2 moving b down to 0.1 changes it (2 -> 1) and up to 10 too
    assert names == {"p1": {"a"}, "p2": {"a", "c"}, "p3": {"a", "c"}, "p4": {"b"}, "p5": {"d"},
                     "p6": {"b", "c"}}  # fmt: skip
    # at b = 0.5 only the upper bound (10) moves p6: both bounds must be probed
    names_low = {KNOBS[i].name for i in _fitter().sensitivity(replace(START, b=0.5))["p6"]}
    assert names_low == {"b", "c"}


def test_fit_recovers_the_true_parameters() -> None:
    res = _fitter().fit(START, max_sweeps=60, rtol=1e-9)
    for k in ("a", "b", "c", "d"):
        assert res.values[k] == pytest.approx(getattr(TRUE, k), rel=1e-4), k
    assert res.unpinned == ()
    assert all(r == pytest.approx(1.0, rel=1e-4) for r in res.ratios.values())
    assert res.cost < 1e-8


def test_unpinned_knob_takes_its_prior() -> None:
    res = _fitter().fit(START, ("p1", "p2", "p3", "p4"), max_sweeps=60, rtol=1e-9)
    assert res.unpinned == ("d",)
    assert res.values["d"] == 0.8  # the prior, not the start (1.0) or the truth (1.5)
    assert res.values["a"] == pytest.approx(2.0, rel=1e-4)


def test_cache_prices_each_point_once_per_knob_values() -> None:
    calls: list[tuple[str, ...]] = []
    f = Fitter(KNOBS, _predictor(MEASURED, calls), POINTS)
    f.sensitivity(START)
    calls.clear()
    f.ratios(START, ("p1", "p5"))
    f.ratios(replace(START, b=7.0), ("p1", "p5"))  # b moves neither point: cached
    assert calls == [("p1", "p5")]
    f.ratios(replace(START, a=3.0), ("p1", "p5"))  # a moves p1 only
    assert calls[-1] == ("p1",)


def test_discrete_knob_tries_each_value() -> None:
    k = Knob("a", lambda p: p.a, lambda p, v: replace(p, a=v), (1.0, 4.0), 1.0, values=(1.0, 2.0, 4.0))
    f = Fitter((k,), _predictor(MEASURED), ("p1",))
    assert f.fit(START).values["a"] == 2.0


def test_loso_bookkeeping_on_consistent_sources() -> None:
    """Exact synthetic data.  Without S1, S2 pins a and c: S1 is predicted exactly.  S2 alone moves b
    (p4, and p6 above its kink), so without S2 b falls back to its prior 1.0: p4 = (1 + 1) / 1.5, p6 =
    max(1, 1) + 3 = 4 = measured.  S3 alone pins d: without it d = prior 0.8, p5 = 0.8 * 4 / 6."""
    f = _fitter()
    res = leave_one_source_out(f, START, SOURCES, max_sweeps=60, rtol=1e-9)
    assert set(res.held_out) == set(POINTS)
    assert [s.source for s in res.sources] == ["S1", "S2", "S3"]
    by = {s.source: s for s in res.sources}
    for src in SOURCES:
        assert set(by[src].fit.points) == set(POINTS) - set(SOURCES[src])
        assert set(by[src].ratios) == set(SOURCES[src])
    assert all(r == pytest.approx(1.0, rel=1e-4) for r in by["S1"].ratios.values())
    assert by["S2"].fit.unpinned == ("b",)
    assert by["S2"].ratios["p4"] == pytest.approx(2.0 / 1.5, rel=1e-12)
    assert by["S2"].ratios["p6"] == pytest.approx(1.0, rel=1e-4)
    assert by["S2"].ratios["p3"] == pytest.approx(1.0, rel=1e-4)
    assert by["S3"].ratios["p5"] == pytest.approx(0.8 * 4.0 / 6.0, rel=1e-12)
    assert by["S3"].fit.unpinned == ("d",)
    assert res.held_out["p4"] == by["S2"].ratios["p4"]
    assert [(fl.knob, fl.source) for fl in res.flags] == [("b", "S2"), ("d", "S3")]
    assert all("unpinned" in fl.why for fl in res.flags)


def test_loso_flags_a_knob_pinned_by_disagreeing_sources() -> None:
    """p1 = 1 + a measured at a = 1 (S1), p3' = 2a measured at a = 2 (S2): full fit minimises
    log((1+a)/2)^2 + log(a/2)^2; without S1, a = 2 (p1 predicted 3/2); without S2, a = 1 (p3' = 1/2)."""
    figs = {"p1": lambda p: 1.0 + p.a, "p3": lambda p: 2.0 * p.a}
    meas = {"p1": 2.0, "p3": 4.0}
    k = _knob("a", 1.0, tolerance=1.25)

    def predict(params, names):
        return {n: figs[n](params) / meas[n] for n in names}

    f = Fitter((k,), predict, ("p1", "p3"), refine=40)
    res = leave_one_source_out(f, Toy(), {"S1": ("p1",), "S2": ("p3",)}, max_sweeps=5, rtol=1e-9)
    # full-fit optimum: d/da [log((1+a)/2)^2 + log(a/2)^2] = 0 -> log((1+a)/2)/(1+a) + log(a/2)/a = 0
    a = res.full.values["a"]
    assert math.log((1 + a) / 2) / (1 + a) + math.log(a / 2) / a == pytest.approx(0.0, abs=1e-6)
    by = {s.source: s for s in res.sources}
    assert by["S1"].fit.values["a"] == pytest.approx(2.0, rel=1e-6)
    assert by["S1"].ratios["p1"] == pytest.approx(1.5, rel=1e-6)
    assert by["S2"].fit.values["a"] == pytest.approx(1.0, rel=1e-6)
    assert by["S2"].ratios["p3"] == pytest.approx(0.5, rel=1e-6)
    # a ~ 1.67: without S1 a = 2 is within x1.25 of it (2/1.67 = 1.20); without S2 a = 1 is not (1.67)
    assert 1.6 < a < 1.7
    assert [(fl.knob, fl.source) for fl in res.flags] == [("a", "S2")]
    # a stated range 0.9..2.1 contains both re-fits: no flag
    ranged = replace(k, stated_range=(0.9, 2.1))
    f2 = Fitter((ranged,), predict, ("p1", "p3"), refine=40)
    assert leave_one_source_out(f2, Toy(), {"S1": ("p1",), "S2": ("p3",)}).flags == ()


def test_out_of_bounds_rules() -> None:
    k = _knob("a", 1.0, tolerance=1.25, tolerance_abs=0.5)
    assert k.out_of_bounds(1.2, 1.0) == ""  # x1.2
    assert k.out_of_bounds(1.4, 1.0) == ""  # x1.4 but |0.4| <= 0.5
    assert k.out_of_bounds(1.6, 1.0) != ""  # x1.6 and |0.6| > 0.5
    ranged = _knob("a", 1.0, stated_range=(1.0, 2.0))
    assert ranged.out_of_bounds(2.0, 1.0) == "" and ranged.out_of_bounds(2.01, 2.0) != ""


def test_geo_summary_values() -> None:
    s = geo_summary([2.0, 0.5, 1.0, 1.3])
    assert s["geomean"] == pytest.approx(1.3**0.25)
    mu = math.log(1.3) / 4
    sd = math.sqrt(sum((math.log(r) - mu) ** 2 for r in (2.0, 0.5, 1.0, 1.3)) / 4)
    assert s["geosd"] == pytest.approx(math.exp(sd))
    assert (s["within_1.25"], s["within_1.5"], s["min"], s["max"]) == (1.0, 2.0, 0.5, 2.0)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"bounds": (1.0, 1.0)}, "lo < hi"),
        ({"bounds": (0.0, 2.0)}, "log=True"),
        ({"prior": 20.0}, "prior"),
        ({"tolerance": 1.0}, "tolerance"),
        ({"values": (0.5, 20.0)}, "values"),
    ],
)
def test_knob_rejects_bad_specs(kw: dict, match: str) -> None:
    base = {"name": "a", "get": lambda p: p.a, "put": lambda p, v: p, "bounds": (0.1, 10.0), "prior": 1.0}
    with pytest.raises(ValueError, match=match):
        Knob(**{**base, **kw})


def test_fitter_and_loso_reject_bad_inputs() -> None:
    with pytest.raises(ValueError, match="unique"):
        Fitter((KNOBS[0], KNOBS[0]), _predictor(MEASURED), POINTS)
    f = _fitter()
    with pytest.raises(ValueError, match="unknown points"):
        f.fit(START, ("p1", "zz"))
    with pytest.raises(ValueError, match="in sources"):
        leave_one_source_out(f, START, {"S1": ("p1",), "S2": ("p1", "p2")})
    with pytest.raises(ValueError, match="two sources"):
        leave_one_source_out(f, START, {"S1": ("p1",)})
    bad = Fitter(KNOBS, lambda p, names: dict.fromkeys(names, -1.0), POINTS)
    with pytest.raises(ValueError, match="non-positive"):
        bad.ratios(START, ("p1",))


def test_levenberg_marquardt_recovers_the_true_parameters_with_few_evaluations() -> None:
    f = _fitter()
    f.sensitivity(START)
    before = f.evaluations
    res = f.fit(START, method="lm", max_sweeps=10, rtol=1e-9)
    for k in ("a", "b", "c", "d"):
        assert res.values[k] == pytest.approx(getattr(TRUE, k), rel=1e-5), k
    cd = _fitter()
    cd.sensitivity(START)
    cd_res = cd.fit(START, method="cd", max_sweeps=60, rtol=1e-9)
    # same optimum, far fewer points priced than coordinate descent at this precision
    assert f.evaluations - before < cd_res.evaluations / 3


def test_levenberg_marquardt_loso_matches_the_hand_computed_held_out_ratios() -> None:
    res = leave_one_source_out(_fitter(), START, SOURCES, method="lm", max_sweeps=10, rtol=1e-9)
    by = {s.source: s for s in res.sources}
    assert by["S2"].ratios["p4"] == pytest.approx(2.0 / 1.5, rel=1e-12)
    assert by["S3"].ratios["p5"] == pytest.approx(0.8 * 4.0 / 6.0, rel=1e-12)
    assert all(r == pytest.approx(1.0, rel=1e-5) for r in by["S1"].ratios.values())
    assert [(fl.knob, fl.source) for fl in res.flags] == [("b", "S2"), ("d", "S3")]


def test_levenberg_marquardt_tries_discrete_knobs() -> None:
    disc = Knob("d", lambda p: p.d, lambda p, v: replace(p, d=v), (0.5, 2.0), 1.0, values=(0.5, 1.5, 2.0))
    f = Fitter((*KNOBS[:3], disc), _predictor(MEASURED), POINTS)
    res = f.fit(START, method="lm", max_sweeps=6, rtol=1e-9)
    assert res.values["d"] == 1.5
    assert res.values["a"] == pytest.approx(2.0, rel=1e-5)


def test_levenberg_marquardt_steps_stay_in_a_trust_box_around_priced_points() -> None:
    """e barely moves p2 (1e-3 e), so its Gauss-Newton step is huge; a little further (e > 1.5) it ruins
    p3.  Every LM trial stays within a quarter of each knob's span (plus the Jacobian's 0.02 probe) of a
    point already priced, and the well-pinned a still reaches 2 (p1 = 1 + a measured 3)."""
    figs = {
        "p1": lambda p: 1.0 + p.a,
        "p2": lambda p: p.a + 1e-3 * p.e,
        "p3": lambda p: 1.0 + 2.0 * max(0.0, p.e - 1.5),
    }
    meas = {"p1": 3.0, "p2": 2.0 + 1e-3, "p3": 1.0}
    seen: list[tuple[float, float]] = []

    def predict(p, names):
        seen.append((p.a, p.e))
        return {n: figs[n](p) / meas[n] for n in names}

    @dataclass(frozen=True)
    class AE:
        a: float = 1.0
        e: float = 1.0

    knobs = (_knob("a", 1.0), _knob("e", 1.0))
    f = Fitter(knobs, predict, tuple(figs))
    f.sensitivity(AE())
    seen.clear()
    res = f.fit(AE(), method="lm", max_sweeps=10, rtol=1e-9)
    span = math.log(10.0 / 0.1)
    for k, (a, e) in enumerate(seen[1:], start=1):
        near = min(max(abs(math.log(a / a0)), abs(math.log(e / e0))) for a0, e0 in seen[:k])
        assert near <= (0.25 + 0.02) * span + 1e-9, (a, e)
    assert res.values["a"] == pytest.approx(2.0, rel=1e-3)
    assert res.values["e"] <= 1.5
