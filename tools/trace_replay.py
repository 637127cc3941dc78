"""Trace replay: every project kernel traced at fixed small shapes, compared with a stored instruction stream.

What it guards: moving kernel code (sharing helpers, renaming, regrouping parameters, splitting modules)
must not change what a kernel issues. For each case of :func:`cases` the kernel is traced on the emulator
(``trace_only=True``, no arithmetic) and its instruction stream is compared with
``tests/data/trace_replay.json``:

* the distinct :class:`~nki_kernels.emulator.trace.TraceRecord` s (op, engine, operand shapes, dtypes and
  buffers, partitions, free size, bytes, flops, DMA descriptors and direction, program id, static meta),
* the program order of the issued instructions (from the trace's event log, ``keep_events=True``): an
  index into the distinct records per instruction, run-length encoded,
* per instruction, an 8-hex digest of the memory regions it reads and writes (allocation ids, numbered in
  order of first access, partitions, byte ranges), so a changed access pattern is caught as well,
* the issue counts per ``engine:op`` (from the aggregated ``Trace.counts``, independent of the order).

Usage (from the repository root)::

    python -m tools.trace_replay            # compare; prints the diff per case, exit 1 if any differs
    python -m tools.trace_replay --update   # same diff, then rewrite tests/data/trace_replay.json
    python -m tools.trace_replay --case attention_bf16_lse_lnc2   # only the named case(s)

``tests/test_trace_replay.py`` runs the comparison in the default suite. Regenerate only for an intended
change of a kernel's instruction stream, and say why in the commit message (docs/testing.md).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DATA_PATH = Path(__file__).resolve().parent.parent / "tests" / "data" / "trace_replay.json"
"""The stored traces (repository-relative: ``tests/data/trace_replay.json``)."""

FORMAT = 1
"""Version of the stored format; a mismatch is reported as a diff of every case."""

REGEN = "python -m tools.trace_replay --update"

RECORD_FIELDS = (
    "op",
    "engine",
    "shapes",
    "dtypes",
    "buffers",
    "partitions",
    "free_elems",
    "bytes_read",
    "bytes_written",
    "flops",
    "descriptors",
    "direction",
    "program_id",
    "meta",
)
"""Every field of a ``TraceRecord``, in the order a stored record row lists them."""


@dataclass(frozen=True)
class Case:
    """One traced launch: ``kernel`` (``(module, name)`` of an ``@nki.jit`` kernel in ``nki_kernels``),
    its positional ``args`` (``TensorSpec`` placeholders, lists of them, compile-time constants), ``lnc``."""

    name: str
    kernel: tuple[str, str]
    args: tuple[Any, ...]
    lnc: int = 1


def _canon(x: Any) -> Any:
    """JSON-stable form of a trace value: tuples and lists as lists, numbers/str/bool/None as they are."""
    if isinstance(x, (tuple, list)):
        return [_canon(v) for v in x]
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return repr(x)


def _describe(arg: Any) -> Any:
    from nki_kernels.emulator import TensorSpec

    if isinstance(arg, TensorSpec):
        return {"shape": list(arg.shape), "dtype": str(arg.dtype)}
    if isinstance(arg, (list, tuple)) and any(isinstance(a, TensorSpec) for a in arg):
        return [_describe(a) for a in arg]
    return _canon(arg)


def cases() -> list[Case]:
    """The replayed launches: every kernel of ``nki_kernels`` at small fixed shapes covering LNC 1 and 2,
    tails (lengths not multiples of 128 / 512 / 1024 / the block), bf16 and fp32, lse on/off, segments,
    several block-table sources, the DMA-transpose P^T path, bias / no bias."""
    from nki_kernels.emulator import TensorSpec

    bf, f32, i32 = "bfloat16", "float32", "int32"

    def s(*shape: int, dtype: str = bf) -> TensorSpec:
        return TensorSpec(shape, dtype)

    def rope(name: str, kern: str, length: int, h: int, d: int, dt: str, lnc: int) -> Case:
        qk = s(2, length, h, d, dtype=dt)
        tab = s(length, d // 2, dtype=f32)
        return Case(name, ("rope3d", kern), (qk, qk, tab, tab), lnc)

    # attention cases: (dma_transpose_chunks, dma_group, static); "_static" names trace the default guarded
    # static softmax offset, the others the running max (the static pass's fallback)
    def att(
        name: str, lq: int, lk: int, dt: str, lse: bool, lnc: int, dma: Any = None, grp: Any = None,
        static: bool = False,
    ) -> Case:  # fmt: skip
        q, kv = s(1, lq, 2, 64, dtype=dt), s(1, lk, 2, 64, dtype=dt)
        return Case(name, ("attention", "attention_kernel"), (q, kv, kv, 0.125, lse, dma, grp, static), lnc)

    def seg(
        name: str, dt: str, lse: bool, lnc: int, segments: tuple[tuple[int, int], ...], static: bool = False
    ) -> Case:
        q, kv = s(1, 130, 2, 64, dtype=dt), s(1, 900, 2, 64, dtype=dt)
        args = (q, kv, kv, segments, 0.125, lse, None, None, static)
        return Case(name, ("attention", "attention_segments_kernel"), args, lnc)

    def blk(
        name: str, dt: str, lse: bool, lnc: int, srcs: Sequence[int], groups: tuple[int, ...], t: int,
        nb: int, static: bool = False,
    ) -> Case:  # fmt: skip
        q = s(1, sum(groups), 2, 64, dtype=dt)
        kv = [s(1, n, 2, 64, dtype=dt) for n in srcs]
        args = (q, kv, kv, s(len(groups), nb, 2, dtype=i32), groups, t, 0.125, lse, None, None, static)
        return Case(name, ("attention_block_table", "attention_block_table_kernel"), args, lnc)

    def kvw(name: str, dt: str, lnc: int) -> Case:
        cache, new = s(2, 96, 3, 16, dtype=dt), s(2, 32, 3, 16, dtype=dt)
        return Case(
            name, ("kv_cache", "kv_cache_write_kernel"), (cache, cache, new, new, s(1, 1, dtype=i32)), lnc
        )

    def kvs(name: str, dt: str, lnc: int, sink: int) -> Case:
        cache, new = s(2, 100, 3, 16, dtype=dt), s(2, 30, 3, 16, dtype=dt)
        return Case(name, ("kv_cache", "kv_cache_slide_kernel"), (cache, cache, new, new, sink), lnc)

    def lin(name: str, m: int, k: int, n: int, dt: str, bias: bool, lnc: int) -> Case:
        args = (s(m, k, dtype=dt), s(k, n, dtype=dt), s(n, dtype=f32) if bias else None)
        return Case(name, ("linear", "linear_kernel"), args, lnc)

    def conv(
        name: str,
        ci: int,
        co: int,
        t: int,
        h: int,
        w: int,
        ks: tuple[int, int, int],
        dt: str,
        bias: bool,
        packing: tuple[int, int] | None = None,
    ) -> Case:
        taps = ks[0] * ks[1] * ks[2]
        args: tuple[Any, ...] = (
            s(ci, t + ks[0] - 1, h, w, dtype=dt),
            s(taps, ci, co, dtype=dt),
            s(co, dtype=f32) if bias else None,
            ks,
        )
        return Case(name, ("conv3d", "conv3d_causal_kernel"), args + ((packing,) if packing else ()), 1)

    def elw(name: str, kern: str, args: tuple[Any, ...], lnc: int) -> Case:
        return Case(name, ("elementwise", kern), args, lnc)

    rows3, x32, x16 = s(3, 520, dtype=f32), s(450, 520, dtype=f32), s(450, 520)
    ew_cases = [
        elw("adaln_bf16_lnc2", "adaln_norm_modulate_kernel", (x16, rows3, rows3, 1e-6), 2),
        elw("adaln_fp32_to_bf16_lnc1", "adaln_norm_modulate_kernel", (x32, rows3, rows3, 1e-6, bf), 1),
        elw("gate_residual_bf16_lnc1", "gate_residual_kernel", (x16, x16, rows3), 1),
        elw("gate_residual_fp32_bf16_lnc2", "gate_residual_kernel", (x32, x16, rows3), 2),
        elw("rms_norm_bf16_lnc1", "rms_norm_kernel", (s(200, 520), s(1, 520, dtype=f32), 1e-6), 1),
        elw("gelu_tanh_bf16_lnc2", "gelu_tanh_kernel", (s(300, 2100),), 2),
        elw("gelu_tanh_fp32_lnc1", "gelu_tanh_kernel", (s(130, 40, dtype=f32),), 1),
        Case("gate_residual_adaln_lnc2", ("elementwise_fused", "gate_residual_adaln_kernel"),
             (x32, x16, rows3, rows3, rows3, 1e-6, bf), 2),
    ]  # fmt: skip

    return ew_cases + [
        rope("rope3d_bf16_lnc1", "rope3d_kernel", 200, 2, 16, bf, 1),
        rope("rope3d_bf16_lnc2", "rope3d_kernel", 1100, 2, 16, bf, 2),
        rope("rope3d_fp32_lnc1", "rope3d_kernel", 130, 2, 16, f32, 1),
        rope("rope3d_naive_bf16_lnc1", "rope3d_naive_kernel", 200, 2, 16, bf, 1),
        # one tensor, H=12 D=64: super-tiles m = 4, 12 (rotated in chunks of 10 and 2 tokens), 4, tail of 40
        Case(
            "rope3d_one_bf16_lnc2",
            ("rope3d", "rope3d_one_kernel"),
            (s(1, 2600, 12, 64),) + (s(2600, 32, dtype=f32),) * 2,
            2,
        ),
        att("attention_bf16_lnc1", 200, 1100, bf, False, 1),
        att("attention_bf16_lse_lnc2", 200, 1100, bf, True, 2),
        att("attention_fp32_lse_lnc1", 130, 600, f32, True, 1),
        att("attention_bf16_dma_transpose_lnc2", 140, 4200, bf, True, 2, (1, 1), 1),
        seg("attention_segments_bf16_lse_lnc2", bf, True, 2, ((0, 64), (200, 300), (770, 130))),
        seg("attention_segments_fp32_lnc1", f32, False, 1, ((10, 530), (899, 1))),
        blk("attention_block_table_bf16_lse_lnc2", bf, True, 2, (256, 96), (32, 64), 32, 3),
        blk("attention_block_table_bf16_lnc1_tail", bf, False, 1, (120,), (40, 50), 40, 2),
        blk("attention_block_table_fp32_lse_lnc1", f32, True, 1, (128, 64, 64), (64, 70), 64, 3),
        att("attention_bf16_lse_lnc2_static", 200, 1100, bf, True, 2, static=True),
        att("attention_bf16_transposed_chunks_lnc1_static", 130, 2100, bf, True, 1, static=True),
        att("attention_bf16_dma_transpose_lnc2_static", 140, 4200, bf, True, 2, (1, 1), 1, static=True),
        seg("attention_segments_bf16_lse_lnc2_static", bf, True, 2, ((0, 64), (200, 300), (770, 130)), True),
        seg("attention_segments_fp32_lnc1_static", f32, False, 1, ((10, 530), (899, 1)), True),
        blk("attention_block_table_bf16_lse_lnc2_static", bf, True, 2, (256, 96), (32, 64), 32, 3, True),
        blk("attention_block_table_fp32_lse_lnc1_static", f32, True, 1, (128, 64, 64), (64, 70), 64, 3, True),
        # 4 entries x 512 keys: the static pass streams K/V (2 full key chunks, 2 entries per chunk)
        blk("attention_block_table_bf16_stream_static", bf, True, 2, (2048,), (70,), 512, 4, True),
        # one key chunk in whole 16-key rows: every head of a query tile at once (cross-attention's pass)
        att("attention_bf16_heads_static", 20, 128, bf, True, 1, static=True),
        kvw("kv_cache_write_bf16_lnc1", bf, 1),
        kvw("kv_cache_write_bf16_lnc2", bf, 2),
        kvw("kv_cache_write_fp32_lnc1", f32, 1),
        kvs("kv_cache_slide_bf16_lnc1", bf, 1, 10),
        kvs("kv_cache_slide_fp32_lnc2", f32, 2, 0),
        lin("linear_bf16_bias_lnc1", 300, 200, 600, bf, True, 1),
        lin("linear_bf16_bias_lnc2", 1300, 260, 700, bf, True, 2),
        lin("linear_fp32_lnc1", 130, 96, 130, f32, False, 1),
        # 3 output rows x 24 channels on the PE columns, 3 row phases x 20 channels on the contraction
        # (zero-filled weight blocks), the time taps looped over a ring of frames
        conv("conv3d_bf16_k333_bias", 20, 24, 2, 9, 13, (3, 3, 3), bf, True, (3, 1)),
        conv("conv3d_fp32_k133", 130, 20, 2, 5, 7, (1, 3, 3), f32, False),
        conv("conv3d_bf16_k311_cin_tiles", 140, 130, 1, 4, 5, (3, 1, 1), bf, True),
    ]


def kernel_of(case: Case) -> Any:
    import importlib

    module, name = case.kernel
    return getattr(importlib.import_module(f"nki_kernels.{module}"), name)


def _region_digest(reads: tuple, writes: tuple) -> str:
    text = repr(([tuple(r) for r in reads], [tuple(r) for r in writes]))
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def capture_trace(trace: Any, case: Case) -> dict[str, Any]:
    """The stored form of ``trace`` (recorded with ``keep_events=True``) for ``case``."""
    index: dict[Any, int] = {}
    records: list[list[Any]] = []
    order: list[list[int]] = []
    regions: list[str] = []
    for rec, reads, writes in trace.iter_events():
        i = index.get(rec)
        if i is None:
            i = index[rec] = len(records)
            records.append([_canon(getattr(rec, f)) for f in RECORD_FIELDS])
        if order and order[-1][0] == i:
            order[-1][1] += 1
        else:
            order.append([i, 1])
        regions.append(_region_digest(reads, writes))
    counts: dict[str, int] = {}
    for rec, n in trace.entries():
        key = f"{rec.engine}:{rec.op}"
        counts[key] = counts.get(key, 0) + n
    return {
        "kernel": ".".join(case.kernel),
        "lnc": case.lnc,
        "args": [_describe(a) for a in case.args],
        "instructions": trace.num_instructions,
        "counts": dict(sorted(counts.items())),
        "records": records,
        "order": order,
        "regions": regions,
    }


def capture(case: Case) -> dict[str, Any]:
    """Trace ``case`` (trace-only, with the event log) and return its stored form."""
    from nki_kernels.emulator import run

    _, trace = run(kernel_of(case), *case.args, lnc=case.lnc, trace_only=True, keep_events=True)
    return capture_trace(trace, case)


# --------------------------------------------------------------------------------------------------
# diff


def _expand(entry: dict[str, Any]) -> list[int]:
    return [i for i, n in entry["order"] for _ in range(n)]


def _show(row: list[Any]) -> str:
    return "{" + ", ".join(f"{f}={json.dumps(v)}" for f, v in zip(RECORD_FIELDS, row)) + "}"


def _record_diff(old: list[Any], new: list[Any]) -> str:
    changed = [
        f"{f}: {json.dumps(a)} -> {json.dumps(b)}" for f, a, b in zip(RECORD_FIELDS, old, new) if a != b
    ]
    return "; ".join(changed)


def regions_at(case: Case, pos: int) -> str:
    """The memory regions instruction ``pos`` of ``case`` reads and writes now (for a region diff: the file
    keeps only their digest)."""
    from nki_kernels.emulator import run

    _, trace = run(kernel_of(case), *case.args, lnc=case.lnc, trace_only=True, keep_events=True)
    for i, (_, reads, writes) in enumerate(trace.iter_events()):
        if i == pos:
            show = [
                f"{kind} {r.space}#{r.buf} p[{r.p0}:{r.p1}) b[{r.b0}:{r.b1})"
                for kind, regs in (("read", reads), ("write", writes))
                for r in regs
            ]
            return "; ".join(show)
    raise ValueError(f"{case.name} issues fewer than {pos + 1} instructions")


def diff(
    expected: dict[str, Any] | None, actual: dict[str, Any] | None, case: Case | None = None
) -> list[str]:
    """Readable differences between a stored case and a fresh capture (empty when identical): changed
    arguments, changed counts per ``engine:op``, the first instruction whose record differs (both records
    and the fields that changed), else the first instruction whose memory regions differ (with the regions
    it accesses now when ``case`` is given)."""
    if expected is None:
        return ["new case (not in the stored file)"]
    if actual is None:
        return ["stored case no longer defined in tools/trace_replay.py cases()"]
    out: list[str] = []
    for key in ("kernel", "lnc", "args"):
        if expected[key] != actual[key]:
            out.append(f"{key} changed: {json.dumps(expected[key])} -> {json.dumps(actual[key])}")
    if expected["instructions"] != actual["instructions"]:
        out.append(f"instructions: {expected['instructions']} -> {actual['instructions']}")
    ec, ac = expected["counts"], actual["counts"]
    for key in sorted(set(ec) | set(ac)):
        if ec.get(key, 0) != ac.get(key, 0):
            out.append(f"count {key}: {ec.get(key, 0)} -> {ac.get(key, 0)}")
    eo, ao = _expand(expected), _expand(actual)
    erec, arec = expected["records"], actual["records"]
    for pos, (i, j) in enumerate(zip(eo, ao)):
        if erec[i] != arec[j]:
            out.append(f"first differing instruction #{pos} of {len(eo)} -> {len(ao)}:")
            out.append(f"  stored: {_show(erec[i])}")
            out.append(f"  now:    {_show(arec[j])}")
            out.append(f"  fields: {_record_diff(erec[i], arec[j])}")
            return out
    if len(eo) != len(ao):
        pos = min(len(eo), len(ao))
        longer, rows = (eo, erec) if len(eo) > len(ao) else (ao, arec)
        which = "stored" if len(eo) > len(ao) else "now"
        out.append(
            f"program order: {len(eo)} -> {len(ao)} instructions, equal up to #{pos}; "
            f"next ({which}): {_show(rows[longer[pos]])}"
        )
        return out
    for pos, (a, b) in enumerate(zip(expected["regions"], actual["regions"])):
        if a != b:
            out.append(
                f"first instruction whose memory regions differ: #{pos} {_show(arec[ao[pos]])} "
                "(allocation ids, partitions or byte ranges it reads/writes changed)"
            )
            if case is not None:
                out.append(f"  now: {regions_at(case, pos)}")
            return out
    if not out and expected != actual:
        out.append("stored entry differs in form (format change?): regenerate")
    return out


# --------------------------------------------------------------------------------------------------
# file


def load(path: Path = DATA_PATH) -> dict[str, dict[str, Any]]:
    """The stored cases by name (``{}`` if the file is missing or of another format)."""
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    if data.get("format") != FORMAT:
        return {}
    return dict(data["cases"])


def dumps(entries: dict[str, dict[str, Any]]) -> str:
    """The file text: one case field per line and one record per line, so a regeneration diffs readably."""
    c = json.dumps
    lines = ["{", f' "format": {FORMAT},', f' "regenerate": {c(REGEN)},', ' "cases": {']
    names = list(entries)
    for n, name in enumerate(names):
        e = entries[name]
        lines.append(f"  {c(name)}: {{")
        keys = list(e)
        for k, key in enumerate(keys):
            sep = "," if k < len(keys) - 1 else ""
            if key == "records":
                lines.append('   "records": [')
                rows = e[key]
                lines += [
                    f"    {c(r, separators=(',', ':'))}{',' if i < len(rows) - 1 else ''}"
                    for i, r in enumerate(rows)
                ]
                lines.append(f"   ]{sep}")
            else:
                lines.append(f"   {c(key)}: {c(e[key], separators=(',', ':'))}{sep}")
        lines.append("  }" + ("," if n < len(names) - 1 else ""))
    lines += [" }", "}", ""]
    return "\n".join(lines)


def compare(
    names: Sequence[str] | None = None,
    path: Path = DATA_PATH,
    capture_fn: Callable[[Case], dict[str, Any]] = capture,
) -> tuple[dict[str, dict[str, Any]], dict[str, list[str]]]:
    """Capture the cases (all, or ``names``) and diff them with the stored file.

    Returns ``(captured, diffs)``: the fresh entries by name and the non-empty diffs by name (a stored case
    that :func:`cases` no longer defines is reported when all cases are compared)."""
    stored = load(path)
    defined = {c.name: c for c in cases()}
    if names:
        unknown = [n for n in names if n not in defined]
        if unknown:
            raise ValueError(f"--case: unknown case(s) {unknown}; defined: {sorted(defined)}")
    todo = [defined[n] for n in names] if names else list(defined.values())
    captured = {c.name: capture_fn(c) for c in todo}
    diffs = {n: d for n, e in captured.items() if (d := diff(stored.get(n), e, defined[n]))}
    if not names:
        for n in stored:
            if n not in defined:
                diffs[n] = diff(stored[n], None)
    return captured, diffs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--update", action="store_true", help=f"rewrite {DATA_PATH.name} after printing the diff")
    ap.add_argument("--case", action="append", default=[], help="only this case (repeatable)")
    ap.add_argument("--list", action="store_true", help="list the case names and exit")
    ns = ap.parse_args(argv)
    if ns.list:
        for c in cases():
            print(f"{c.name}  {'.'.join(c.kernel)} lnc={c.lnc}")
        return 0
    captured, diffs = compare(ns.case or None)
    for name, lines in diffs.items():
        print(f"[{name}]")
        for line in lines:
            print(f"  {line}")
    rel = DATA_PATH.relative_to(DATA_PATH.parents[2])
    print(f"{len(captured)} case(s) traced, {len(diffs)} differ from {rel}")
    if ns.update:
        stored = load()
        merged: dict[str, dict[str, Any]] = {}
        for c in cases():  # the defined cases in order; a case not traced now keeps its stored entry
            entry = captured.get(c.name, stored.get(c.name))
            if entry is not None:
                merged[c.name] = entry
        DATA_PATH.parent.mkdir(parents=True, exist_ok=True)
        DATA_PATH.write_text(dumps(merged))
        print(f"wrote {len(merged)} case(s); say why in the commit message")
        return 0
    if diffs:
        print(f"if the change is intended: {REGEN} (and say why in the commit message)")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
