"""Fit a cost model's fitted parameters to published points, and leave-one-source-out (LOSO) validation.

Generic over the parameter object and the model: a :class:`Knob` reads and replaces one fitted parameter
of any immutable parameter object (``get(params) -> float``, ``put(params, value) -> params``); a
``predict(params, names) -> {name: ratio}`` callable returns modelled / measured for named points.  The
real cost model's knobs and predictor live in :mod:`perf.calibration.refit`.

The fit minimises the sum of squared ``log(ratio)`` over the fitting points by coordinate descent: each
knob in turn is set by a one-dimensional search over its bounds (log- or linear-spaced grid, then a
golden-section refinement around the best grid value; discrete knobs try each value), on the points that
knob **moves** only.  Which points a knob moves is measured once (:meth:`Fitter.sensitivity`): a point
moves when setting that knob alone to either search bound (or to any of its discrete values) changes
the point's ratio.  A knob that moves none of the fitting points is **unpinned**: it is set to its
``prior`` (the value documented without any calibration fit).  Sweeps repeat until no knob changes by
more than ``rtol``.  Results are cached per point under the values of the knobs that move it, so a
search never re-prices a point whose knobs did not change.

LOSO (:func:`leave_one_source_out`): the full fit on every point; then, per source, the fit without that
source's points (started from the full fit's values) and the prediction of the held-out points.  A knob
is **flagged** when its held-out re-fit leaves its stated range, or (without a range) differs from the
full fit's value by more than its tolerance, or when it is unpinned without that source.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Fitter",
    "FitResult",
    "Flag",
    "Knob",
    "LosoResult",
    "Predict",
    "SourceOutcome",
    "geo_summary",
    "leave_one_source_out",
]

Predict = Callable[[Any, Sequence[str]], Mapping[str, float]]
"""``(params, point names) -> {name: modelled / measured}`` (ratios must be finite and > 0)."""

_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0


@dataclass(frozen=True)
class Knob:
    """One fitted parameter.

    ``get(params) -> float`` reads it, ``put(params, value) -> params`` returns a copy with it replaced.
    ``bounds = (lo, hi)``: the search interval (``log=True``: searched in log space, needs ``lo > 0``).
    ``values``: discrete choices searched exhaustively instead of ``bounds``.  ``prior``: the value used
    when no fitting point moves the knob (the documented value without calibration; ``prior_source``
    says where it comes from).  ``stated_range``: the parameter's stated ``(low, high)`` range, if it has
    one; otherwise ``tolerance`` (a factor > 1) and ``tolerance_abs`` (units) bound how far a held-out
    re-fit may move from the full fit's value before it is flagged: flagged when the ratio leaves
    ``[1/tolerance, tolerance]`` and the absolute change exceeds ``tolerance_abs``.
    """

    name: str
    get: Callable[[Any], float]
    put: Callable[[Any, float], Any]
    bounds: tuple[float, float]
    prior: float
    log: bool = True
    values: tuple[float, ...] = ()
    stated_range: tuple[float, float] | None = None
    tolerance: float = 1.25
    tolerance_abs: float = 0.0
    prior_source: str = ""

    def __post_init__(self) -> None:
        lo, hi = self.bounds
        if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
            raise ValueError(f"Knob {self.name}: bounds must be finite with lo < hi, got {self.bounds}")
        if self.log and lo <= 0:
            raise ValueError(f"Knob {self.name}: log=True needs bounds lo > 0, got {self.bounds}")
        if self.values and any(not lo <= v <= hi for v in self.values):
            raise ValueError(f"Knob {self.name}: values {self.values} must lie within bounds {self.bounds}")
        if not lo <= self.prior <= hi:
            raise ValueError(f"Knob {self.name}: prior {self.prior} must lie within bounds {self.bounds}")
        if not self.tolerance > 1.0 or self.tolerance_abs < 0:
            raise ValueError(
                f"Knob {self.name}: tolerance must be > 1 and tolerance_abs >= 0, got "
                f"{self.tolerance}, {self.tolerance_abs}"
            )
        if self.stated_range is not None and not self.stated_range[0] <= self.stated_range[1]:
            raise ValueError(f"Knob {self.name}: stated_range must be (low, high), got {self.stated_range}")

    def to_u(self, v: float) -> float:
        return math.log(v) if self.log else v

    def from_u(self, u: float) -> float:
        lo, hi = self.bounds
        return min(max(math.exp(u) if self.log else u, lo), hi)

    def out_of_bounds(self, value: float, reference: float) -> str:
        """Why ``value`` (a held-out re-fit) is flagged against ``reference`` (the full fit), or ``""``."""
        if self.stated_range is not None:
            lo, hi = self.stated_range
            if not lo <= value <= hi:
                return f"outside its stated range {lo:g}..{hi:g}"
            return ""
        diff = abs(value - reference)
        if diff <= self.tolerance_abs:
            return ""
        if reference > 0 and value > 0 and 1 / self.tolerance <= value / reference <= self.tolerance:
            return ""
        return f"moved beyond x{self.tolerance:g} (and {self.tolerance_abs:g}) of the full fit"


@dataclass(frozen=True)
class FitResult:
    """Outcome of :meth:`Fitter.fit`: the fitted ``params`` and knob ``values``, the knobs no fitting
    point moves (``unpinned``, set to their prior), the fitting ``points`` and their ``ratios``,
    ``cost`` = mean squared log ratio, the points priced (``evaluations``) and ``sweeps`` run."""

    params: Any
    values: dict[str, float]
    unpinned: tuple[str, ...]
    points: tuple[str, ...]
    ratios: dict[str, float]
    cost: float
    evaluations: int
    sweeps: int


@dataclass(frozen=True)
class Flag:
    """A knob whose held-out re-fit (``value``) is out of bounds against the full fit (``reference``)."""

    knob: str
    source: str
    value: float
    reference: float
    why: str


@dataclass(frozen=True)
class SourceOutcome:
    """One held-out source: its points' ``ratios`` predicted by the ``fit`` without them, and ``flags``."""

    source: str
    points: tuple[str, ...]
    fit: FitResult
    ratios: dict[str, float]
    flags: tuple[Flag, ...]


@dataclass(frozen=True)
class LosoResult:
    """The full fit, one :class:`SourceOutcome` per source, and every point's held-out ratio."""

    full: FitResult
    sources: tuple[SourceOutcome, ...]
    held_out: dict[str, float] = field(default_factory=dict)

    @property
    def flags(self) -> tuple[Flag, ...]:
        return tuple(f for s in self.sources for f in s.flags)


def geo_summary(ratios: Iterable[float]) -> dict[str, float]:
    """``{"n", "geomean", "geosd", "min", "max", "within_1.25", "within_1.5"}`` of positive ratios
    (geometric SD = ``exp`` of the population SD of ``log(ratio)``; 1.0 for one ratio)."""
    rs = list(ratios)
    if not rs or any(not (r > 0 and math.isfinite(r)) for r in rs):
        raise ValueError(f"geo_summary: ratios must be a non-empty set of finite positive numbers, got {rs}")
    logs = [math.log(r) for r in rs]
    mu = sum(logs) / len(logs)
    sd = math.sqrt(sum((x - mu) ** 2 for x in logs) / len(logs))
    return {
        "n": float(len(rs)),
        "geomean": math.exp(mu),
        "geosd": math.exp(sd),
        "min": min(rs),
        "max": max(rs),
        "within_1.25": float(sum(1 for r in rs if abs(math.log(r)) <= math.log(1.25) + 1e-12)),
        "within_1.5": float(sum(1 for r in rs if abs(math.log(r)) <= math.log(1.5) + 1e-12)),
    }


class Fitter:
    """Coordinate-descent fit of ``knobs`` against ``predict`` (module docstring).

    ``points``: every point name the fitter may price.  ``grid``: grid points per continuous search;
    ``refine``: golden-section iterations after the grid.  ``eps``: the relative change of a ratio below
    which a knob does not move a point.
    """

    def __init__(
        self,
        knobs: Sequence[Knob],
        predict: Predict,
        points: Sequence[str],
        *,
        grid: int = 9,
        refine: int = 8,
        eps: float = 1e-9,
    ) -> None:
        names = [k.name for k in knobs]
        if len(set(names)) != len(names):
            raise ValueError(f"Fitter: knob names must be unique, got {names}")
        if not knobs:
            raise ValueError("Fitter: needs at least one knob")
        if len(set(points)) != len(points) or not points:
            raise ValueError(f"Fitter: points must be non-empty and unique, got {list(points)}")
        if grid < 3 or refine < 0:
            raise ValueError(f"Fitter: grid must be >= 3 and refine >= 0, got {grid}, {refine}")
        self.knobs = tuple(knobs)
        self.predict = predict
        self.points = tuple(points)
        self.grid = grid
        self.refine = refine
        self.eps = eps
        self.movers: dict[str, tuple[int, ...]] | None = None
        self._cache: dict[tuple[str, tuple[float, ...]], float] = {}
        self.evaluations = 0

    # ------------------------------------------------------------------------------------ evaluation
    def _key(self, name: str, params: Any) -> tuple[str, tuple[float, ...]]:
        idx = range(len(self.knobs)) if self.movers is None else self.movers[name]
        return name, tuple(float(self.knobs[i].get(params)) for i in idx)

    def ratios(self, params: Any, names: Sequence[str]) -> dict[str, float]:
        """``{name: ratio}`` at ``params`` (cached per point under the values of the knobs moving it)."""
        keys = {n: self._key(n, params) for n in names}
        missing = [n for n in names if keys[n] not in self._cache]
        if missing:
            got = self.predict(params, missing)
            for n in missing:
                r = float(got[n])
                if not (r > 0 and math.isfinite(r)):
                    raise ValueError(
                        f"Fitter: predict returned a non-positive or non-finite ratio {r} for {n}"
                    )
                self._cache[keys[n]] = r
            self.evaluations += len(missing)
        return {n: self._cache[keys[n]] for n in names}

    def _sse(self, params: Any, names: Sequence[str]) -> float:
        return sum(math.log(r) ** 2 for r in self.ratios(params, names).values())

    def sensitivity(self, params: Any) -> dict[str, tuple[int, ...]]:
        """Measure which knobs move which points at ``params`` (every knob alone at both bounds / each
        discrete value); sets and returns ``movers`` = ``{point: indices of the knobs moving it}``."""
        self.movers = None
        base = self.ratios(params, self.points)
        moved: dict[str, list[int]] = {n: [] for n in self.points}
        for i, k in enumerate(self.knobs):
            probes = k.values or k.bounds
            for v in probes:
                got = self.ratios(k.put(params, v), self.points)
                for n in self.points:
                    if abs(math.log(got[n] / base[n])) > self.eps and i not in moved[n]:
                        moved[n].append(i)
        self.movers = {n: tuple(sorted(v)) for n, v in moved.items()}
        self._cache.clear()
        return self.movers

    # ------------------------------------------------------------------------------------ search
    def _search(self, i: int, params: Any, names: Sequence[str]) -> float:
        k = self.knobs[i]
        x0 = float(k.get(params))
        u0 = k.to_u(min(max(x0, k.bounds[0]), k.bounds[1]))
        seen: dict[float, float] = {}

        def f(v: float) -> float:
            if v not in seen:
                seen[v] = self._sse(k.put(params, v), names)
            return seen[v]

        f(x0)
        if k.values:
            for v in k.values:
                f(v)
        else:
            ua, ub = k.to_u(k.bounds[0]), k.to_u(k.bounds[1])
            us = [ua + (ub - ua) * j / (self.grid - 1) for j in range(self.grid)]
            vals = [f(k.from_u(u)) for u in us]
            j = min(range(self.grid), key=lambda t: (vals[t], abs(us[t] - u0)))
            a, b = us[max(j - 1, 0)], us[min(j + 1, self.grid - 1)]
            c, d = b - _GOLDEN * (b - a), a + _GOLDEN * (b - a)
            fc, fd = f(k.from_u(c)), f(k.from_u(d))
            for _ in range(self.refine):
                if fc <= fd:
                    b, d, fd = d, c, fc
                    c = b - _GOLDEN * (b - a)
                    fc = f(k.from_u(c))
                else:
                    a, c, fc = c, d, fd
                    d = a + _GOLDEN * (b - a)
                    fd = f(k.from_u(d))
        best = min(seen.values())
        # ties (flat objective): keep the value closest to the start, so a knob does not wander
        tie = [v for v, s in seen.items() if s <= best + 1e-14 * max(1.0, best)]
        return min(tie, key=lambda v: abs(k.to_u(min(max(v, k.bounds[0]), k.bounds[1])) - u0))

    def fit(
        self,
        params: Any,
        points: Sequence[str] | None = None,
        *,
        max_sweeps: int = 4,
        rtol: float = 0.01,
        method: str = "cd",
    ) -> FitResult:
        """Fit every knob to ``points`` (default: all) starting from ``params``; see the module docstring.

        Knobs moving none of ``points`` are set to their prior and reported ``unpinned``.  ``method``:
        ``"cd"`` coordinate descent (stops after a sweep that changes no knob by more than ``rtol``,
        relative, or of the bound span for linear knobs, or after ``max_sweeps``); ``"lm"``
        Levenberg-Marquardt on the continuous knobs (:meth:`_lm`, at most ``4 * max_sweeps`` iterations,
        steps below ``rtol`` of the scaled span stop it) with the discrete knobs tried exhaustively after
        it converges (up to ``max_sweeps`` rounds).
        """
        if method not in ("cd", "lm"):
            raise ValueError(f"Fitter.fit: method must be 'cd' or 'lm', got {method!r}")
        if self.movers is None:
            self.sensitivity(params)
        assert self.movers is not None
        names = tuple(self.points if points is None else points)
        unknown = sorted(set(names) - set(self.points))
        if unknown:
            raise ValueError(f"Fitter.fit: unknown points {unknown}")
        if not names:
            raise ValueError("Fitter.fit: needs at least one fitting point")
        start_evals = self.evaluations
        by_knob = {i: [n for n in names if i in self.movers[n]] for i in range(len(self.knobs))}
        unpinned = tuple(self.knobs[i].name for i, pts in by_knob.items() if not pts)
        for i, pts in by_knob.items():
            if not pts:
                params = self.knobs[i].put(params, self.knobs[i].prior)
        sweeps = 0
        if method == "lm":
            params, sweeps = self._lm_rounds(params, names, by_knob, max_sweeps, rtol)
        else:
            for sweeps in range(1, max_sweeps + 1):  # noqa: B007 (reported)
                changed = False
                for i, pts in by_knob.items():
                    if not pts:
                        continue
                    k = self.knobs[i]
                    old = float(k.get(params))
                    new = self._search(i, params, pts)
                    params = k.put(params, new)
                    span = 1.0 if k.log else (k.bounds[1] - k.bounds[0])
                    if abs(k.to_u(new) - k.to_u(old)) > (math.log1p(rtol) if k.log else rtol * span):
                        changed = True
                if not changed:
                    break
        ratios = self.ratios(params, names)
        cost = sum(math.log(r) ** 2 for r in ratios.values()) / len(names)
        return FitResult(
            params=params,
            values={k.name: float(k.get(params)) for k in self.knobs},
            unpinned=unpinned,
            points=names,
            ratios=ratios,
            cost=cost,
            evaluations=self.evaluations - start_evals,
            sweeps=sweeps,
        )

    # ------------------------------------------------------------------------------ Levenberg-Marquardt
    def _scaled(self, i: int, params: Any) -> float:
        k = self.knobs[i]
        ua, ub = k.to_u(k.bounds[0]), k.to_u(k.bounds[1])
        v = min(max(float(k.get(params)), k.bounds[0]), k.bounds[1])
        return (k.to_u(v) - ua) / (ub - ua)

    def _put_scaled(self, params: Any, i: int, s: float) -> Any:
        k = self.knobs[i]
        ua, ub = k.to_u(k.bounds[0]), k.to_u(k.bounds[1])
        return k.put(params, k.from_u(ua + min(max(s, 0.0), 1.0) * (ub - ua)))

    def _lm(
        self, params: Any, names: Sequence[str], active: Sequence[int], max_iter: int, rtol: float, h: float
    ) -> tuple[Any, int]:
        """Levenberg-Marquardt on the residuals ``log(ratio)`` over ``names`` in the knobs' scaled
        coordinates (0 = lower bound, 1 = upper; log or linear per knob).  The Jacobian is taken by forward
        differences of step ``h`` (backward at the upper bound) on the points each knob moves, then
        updated from each accepted step (Broyden's rank-one update) instead of re-priced; a fresh
        Jacobian is taken again when a step fails or the fit looks converged, and the fit stops when it
        is converged on a fresh Jacobian (a step below ``rtol`` of the scaled span, or a relative drop of
        the sum of squares below 1e-4).  Steps are limited to a quarter of any knob's span (a poorly
        pinned knob has a tiny Jacobian column and a huge Gauss-Newton step), clamped to the bounds and
        accepted only when they lower the sum of squares; at most ``max_iter`` steps."""
        import numpy as np

        if not active:
            return params, 0
        assert self.movers is not None
        movers = self.movers
        row = {n: r for r, n in enumerate(names)}

        def resid(p: Any) -> Any:
            rs = self.ratios(p, names)
            return np.array([math.log(rs[n]) for n in names])

        def jacobian(p: Any, r0: Any) -> Any:
            jac = np.zeros((len(names), len(active)))
            for c, i in enumerate(active):
                s0 = self._scaled(i, p)
                step = h if s0 + h <= 1.0 else -h
                pts = [n for n in names if i in movers[n]]
                got = self.ratios(self._put_scaled(p, i, s0 + step), pts)
                for n in pts:
                    jac[row[n], c] = (math.log(got[n]) - r0[row[n]]) / step
            return jac

        r = resid(params)
        sse = float(r @ r)
        jac = jacobian(params, r)
        fresh = True
        lam = 1e-2
        it = 0
        for it in range(1, max_iter + 1):  # noqa: B007 (reported)
            a = jac.T @ jac
            g = jac.T @ r
            accepted = converged = False
            for _ in range(12):
                delta = np.linalg.solve(a + lam * (np.diag(np.diag(a)) + 1e-9 * np.eye(len(active))), -g)
                delta = np.clip(delta, -0.25, 0.25)  # trust box: a quarter of each knob's span per step
                trial = params
                for c, i in enumerate(active):
                    trial = self._put_scaled(trial, i, self._scaled(i, params) + float(delta[c]))
                rt = resid(trial)
                st = float(rt @ rt)
                if st < sse:
                    step = np.array([self._scaled(i, trial) - self._scaled(i, params) for i in active])
                    converged = float(np.max(np.abs(step))) < rtol or sse - st < 1e-4 * sse
                    if float(step @ step) > 0:  # Broyden: J += (dr - J ds) ds^T / (ds^T ds)
                        jac = jac + np.outer(rt - r - jac @ step, step) / float(step @ step)
                    params, r, sse, accepted = trial, rt, st, True
                    lam = max(lam / 3.0, 1e-6)
                    break
                lam *= 4.0
            if (not accepted or converged) and fresh:
                break
            if not accepted or converged:
                jac, fresh, lam = jacobian(params, r), True, 1e-2
            else:
                fresh = False
        return params, it

    def _lm_rounds(
        self,
        params: Any,
        names: Sequence[str],
        by_knob: Mapping[int, Sequence[str]],
        rounds: int,
        rtol: float,
    ) -> tuple[Any, int]:
        cont = [i for i, pts in by_knob.items() if pts and not self.knobs[i].values]
        disc = [i for i, pts in by_knob.items() if pts and self.knobs[i].values]
        total = 0
        for _ in range(max(rounds, 1)):
            params, it = self._lm(params, names, cont, 10 * max(rounds, 1), rtol, 0.02)
            total += it
            changed = False
            for i in disc:
                k = self.knobs[i]
                old = float(k.get(params))
                best = self._search(i, params, by_knob[i])
                params = k.put(params, best)
                changed |= best != old
            if not changed:
                break
        return params, total


def leave_one_source_out(
    fitter: Fitter,
    params: Any,
    groups: Mapping[str, Sequence[str]],
    *,
    max_sweeps: int = 4,
    rtol: float = 0.01,
    method: str = "cd",
    progress: Callable[[str], None] | None = None,
) -> LosoResult:
    """Full fit on every grouped point, then per source (``groups``: source -> its point names, disjoint,
    covering the points to validate) the fit without it, started from the full fit's values, and the
    prediction of its points.  Flags per :meth:`Knob.out_of_bounds` and for knobs unpinned without the
    source (set to their prior)."""
    seen: dict[str, str] = {}
    for src, names in groups.items():
        if not names:
            raise ValueError(f"leave_one_source_out: source {src!r} has no points")
        for n in names:
            if n in seen:
                raise ValueError(f"leave_one_source_out: point {n!r} is in sources {seen[n]!r} and {src!r}")
            seen[n] = src
    if len(groups) < 2:
        raise ValueError("leave_one_source_out: needs at least two sources")
    every = tuple(seen)
    if fitter.movers is None:
        fitter.sensitivity(params)
    full = fitter.fit(params, every, max_sweeps=max_sweeps, rtol=rtol, method=method)
    if progress:
        progress(f"full fit: {full.evaluations} point prices, cost {full.cost:.4f}")
    outcomes = []
    held: dict[str, float] = {}
    for src, names in groups.items():
        if progress:
            progress(f"without {src}")
        keep = tuple(n for n in every if seen[n] != src)
        res = fitter.fit(full.params, keep, max_sweeps=max_sweeps, rtol=rtol, method=method)
        pred = fitter.ratios(res.params, tuple(names))
        held.update(pred)
        flags = []
        for k in fitter.knobs:
            v, ref = res.values[k.name], full.values[k.name]
            if k.name in res.unpinned and k.name not in full.unpinned:
                flags.append(Flag(k.name, src, v, ref, f"unpinned without this source (prior {k.prior:g})"))
                continue
            why = k.out_of_bounds(v, ref)
            if why:
                flags.append(Flag(k.name, src, v, ref, why))
        outcomes.append(SourceOutcome(src, tuple(names), res, pred, tuple(flags)))
    return LosoResult(full=full, sources=tuple(outcomes), held_out=held)
