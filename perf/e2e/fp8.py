"""The ``fp8_linear`` chunk variant: the merged chunk with the DiT's linear layers priced as the FP8 linear
kernel (``nki_kernels.linear_fp8``: e4m3 double-row matmuls, per-token activation scales computed in the
kernel) instead of the bf16 one; everything else (attention, elementwise passes, VAE convolutions,
communication) unchanged.  Linears with ``K`` or ``N`` below :data:`FP8_MIN_DIM` (patch embedding,
output head) stay bf16.  All figures **modelled**.

The FP8 linears are an option, off by default: their error gate (``perf/fp8_gate.py``, measured) does
not pass per linear, nor does its decoded-video half on the demo model (``perf/fp8_psnr.py``,
``docs/kernels/linear_fp8.md``).  The report's targets table shows the variant as "with FP8 linears" at
both parameter ends; :func:`fp8_gate_lines` is the report's table of both FP8 options' gates (measured).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from perf.e2e.params import ENDS
from perf.matmul_model import LINEAR_TRACE_TOKENS, BlockProfile, TracedLinearProvider, profile_block

__all__ = [
    "FP8_MIN_DIM",
    "VARIANT",
    "TracedLinearFp8Provider",
    "fp8_gate_lines",
    "fp8_linear_chunks",
    "fp8_target_lines",
]

FP8_MIN_DIM = 256
"""Smallest ``K`` and ``N`` a linear runs in FP8 (the patch embedding, K = 64, and the output head,
N = 64, stay bf16: tiny, and the first and last layers, where FP8 deployments usually keep precision)."""

VARIANT = "fp8_linear"
"""The variant's key in ``E2EResult.chunks`` (``(VARIANT, end)``)."""


@dataclass
class TracedLinearFp8Provider:
    """A :class:`~perf.matmul_model.MatmulProvider` whose whole-GEMM :meth:`linear` is one call of
    ``nki_kernels.linear_fp8.linear_fp8_kernel`` (bf16 activations, e4m3 weights, fp32 bias), traced
    trace-only with its event log and priced by cost model v2 at both ends; GEMMs longer than
    ``LINEAR_TRACE_TOKENS`` are traced at that length (a multiple of the kernel's ``bm``) and scaled, as
    :class:`~perf.matmul_model.TracedLinearProvider` does.  Linears below :data:`FP8_MIN_DIM`, the
    tile-level :meth:`block` and the VAE's :meth:`conv` go to the bf16 ``inner`` provider."""

    inner: TracedLinearProvider = field(default_factory=TracedLinearProvider)
    name: str = "traced (linear_fp8 kernel; bf16 linear kernel below K, N = 256; bf16 convs)"
    _cache: dict[tuple[int, int, int], BlockProfile] = field(default_factory=dict)

    def block(self, block_m: int, k: int, block_n: int) -> BlockProfile:
        return self.inner.block(block_m, k, block_n)

    def conv(self, *args: Any) -> BlockProfile:
        return self.inner.conv(*args)

    def linear(self, m: int, k: int, n: int) -> BlockProfile:
        for arg, v in (("m", m), ("k", k), ("n", n)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"TracedLinearFp8Provider.linear: {arg} must be a positive int, got {v!r}")
        if min(k, n) < FP8_MIN_DIM:
            return self.inner.linear(m, k, n)
        key = (m, k, n)
        if key not in self._cache:
            import ml_dtypes

            from nki_kernels.emulator import TensorSpec, run
            from nki_kernels.emulator.cost import profile_range
            from nki_kernels.linear_fp8 import linear_fp8_kernel, plan_tiles_fp8

            bm = plan_tiles_fp8(m, k, n, 2)[0]
            mt = m if m <= LINEAR_TRACE_TOKENS else max(bm, LINEAR_TRACE_TOKENS // bm * bm)
            specs = (
                TensorSpec((mt, k), ml_dtypes.bfloat16),
                TensorSpec((k, n), ml_dtypes.float8_e4m3),
                TensorSpec((n,), "float32"),
                TensorSpec((n,), "float32"),
            )
            _, trace = run(linear_fp8_kernel, *specs, trace_only=True, keep_events=True)
            lo, hi = profile_range(trace, self.inner.params, schedule=True)
            f = m / mt
            src = f"traced linear_fp8 kernel ({lo.model})"
            src += f", {mt} of {m} tokens scaled" if f != 1 else ""
            self._cache[key] = profile_block(lo, hi, trace, (m, n, k), 2 * m * k * n, src, f)
        return self._cache[key]


def fp8_linear_chunks(m: Any, pipe: Any, *, cores: int, kw: dict[str, Any]) -> dict[str, Any]:
    """``{end: ChunkModel}`` of the merged chunk with FP8 linears; ``kw`` = :func:`perf.e2e.run.run_model`'s
    chunk-model keywords (its ``matmul`` becomes the bf16 ``inner`` provider when it is a traced one)."""
    from perf.e2e.chunk import chunk_model

    inner = kw.get("matmul")
    bf16 = inner if isinstance(inner, TracedLinearProvider) else TracedLinearProvider()
    kw8 = {**kw, "matmul": TracedLinearFp8Provider(bf16)}
    return {end: chunk_model(m, pipe, cores=cores, variant="merged", end=end, **kw8) for end in ENDS}


def fp8_target_lines(r: Any) -> list[str]:
    """The targets-table row of the frame-rate target with FP8 linears (empty without the variant)."""
    if (VARIANT, "pessimistic") not in r.chunks:
        return []
    prm = r.params
    lo, hi = r.chunk(VARIANT, "pessimistic"), r.chunk(VARIANT, "optimistic")
    ok = {e: r.chunk(VARIANT, e).headroom() >= prm.target_headroom for e in ENDS}
    lin = {e: r.chunk(VARIANT, e).by_group().get("linear", 0.0) * 1e3 for e in ENDS}
    lin16 = {e: r.chunk("merged", e).by_group().get("linear", 0.0) * 1e3 for e in ENDS}
    return [
        f"| >= {prm.target_fps:.0f} fps with FP8 linears (option off: its error gate fails per linear, "
        f"docs/kernels/linear_fp8.md) | {lo.fps:.2f} / {hi.fps:.2f} fps, chunk {lo.chunk_s * 1e3:.0f} / "
        f"{hi.chunk_s * 1e3:.0f} ms, linears {lin['pessimistic']:.0f} / {lin['optimistic']:.0f} ms (bf16 "
        f"{lin16['pessimistic']:.0f} / {lin16['optimistic']:.0f}) | {'yes' if ok['pessimistic'] else 'no'} / "
        f"{'yes' if ok['optimistic'] else 'no'} |"
    ]


def fp8_gate_lines(psnr_rows: str | None = None) -> list[str]:
    """The report's FP8 gates table (**measured**): per option, the tensor half (``perf/fp8_gate.py``: Wan2.1
    block shapes, random weights, computed here, ~10 s of CPU) and the decoded-video half on the demo model
    (the newest rows of ``perf/results/fp8_psnr.jsonl``, or ``psnr_rows``, written by
    ``python -m perf.fp8_psnr --save``)."""
    from perf.fp8_gate import GateConfig, gate, kv_gate
    from perf.fp8_psnr import latest_gates

    cfg = GateConfig()
    lin, kv = gate(cfg), kv_gate(cfg)
    kv0 = kv_gate(GateConfig(outlier_frac=0.0))
    video = latest_gates(psnr_rows)

    def vid(name: str) -> str:
        g = video.get(name)
        if g is None:
            return "not run (`python -m perf.fp8_psnr --save`)"
        verdict = "passes" if g["passed"] else "fails"
        return (
            f"{g['psnr_db_min']:.1f}-{g['psnr_db_max']:.1f} dB over {g['prompts']} prompts (>= "
            f"{g['threshold_db']:g}: {verdict}; the bf16 stream's own PSNR against fp32: >= "
            f"{g['bf16_vs_fp32_db_min']:.1f} dB)"
        )

    e8 = [r.err_fp8 for r in lin]
    bd = [r.bound for r in lin]
    lin_ok = all(r.passed for r in lin)
    return [
        "## FP8 gates (measured; both options off by default)\n",
        f"Rule: the FP8 path's relative error against bf16 <= {cfg.factor:g} x the bf16 path's own error "
        f"against fp32 + {cfg.floor:.4g} (Wan2.1-1.3B block shapes, random weights, {cfg.tokens} tokens, "
        "`perf/fp8_gate.py`), AND the decoded video of the trained demo model streamed 30 s with the option "
        "against the bf16 stream (same prompt and noise) >= 35 dB PSNR (`python -m perf.fp8_psnr`).\n",
        "| option | tensor gate | decoded-video gate (demo model) | default |",
        "|---|---|---|---|",
        f"| FP8 linears (every block linear) | {'passes' if lin_ok else 'fails'}: error {min(e8):.2%}-"
        f"{max(e8):.2%} against bounds {min(bd):.2%}-{max(bd):.2%} ({len(lin)} linears) | "
        f"{vid('fp8_linears')} | off |",
        f"| FP8 KV cache | {'passes' if kv.passed else 'fails'}: error {kv.err_fp8:.2%} against "
        f"{kv.bound:.2%} (self-attention output); without the 1 % outlier channels {kv0.err_fp8:.2%} against "
        f"{kv0.bound:.2%} ({'passes' if kv0.passed else 'fails'}) | {vid('fp8_kv_cache')} | off: its tensor "
        "half passes only "
        "with outlier channels, so it waits for a measurement on the real checkpoint's activations |",
        "",
    ]
