"""The ``fp8_linear`` chunk variant: the merged chunk with the DiT's linear layers priced as the FP8 linear
kernel (``nki_kernels.linear_fp8``: e4m3 double-row matmuls, per-token activation scales computed in the
kernel) instead of the bf16 one; everything else (attention, elementwise passes, VAE convolutions,
communication) unchanged.  Linears with ``K`` or ``N`` below :data:`FP8_MIN_DIM` (patch embedding,
output head) stay bf16.  All figures **modelled**.

The FP8 linears are an option, off by default: their error gate (``perf/fp8_gate.py``, measured) does
not pass per linear, nor does its decoded-video half on the demo model (``perf/fp8_psnr.py``,
``docs/kernels/linear_fp8.md``).  The report's targets table shows the variant as "with FP8 linears" at
both parameter ends; :func:`fp8_gate_lines` is the report's table of the FP8 options' gates (measured).

FP8 attention (``attn_fp8`` on the pipeline, ``fp8=True`` on the attention ops: P.V in e4m3 on double-row
matmuls, docs/kernels/attention_fp8.md): :func:`fp8_attention_cost` traces the block-table
kernel with the option at the merged forward's per-core shape (the ``attn_merged`` component of
``perf/e2e/components.py``) and :func:`fp8_attention_chunk` prices the merged chunk with that component
swapped (the components are additive); the targets table's "FP8 attention" row (:func:`fp8_target_lines`).
``python -m perf.e2e.fp8`` prints the per-layer comparison and the engines' busy times (~1 min).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import cache
from typing import Any

from nki_kernels.ops_attention import FP8_MIN_KEYS
from perf.e2e.params import ENDS
from perf.matmul_model import LINEAR_TRACE_TOKENS, BlockProfile, TracedLinearProvider, profile_block

__all__ = [
    "ATTN_COMPONENT",
    "FP8_MIN_DIM",
    "VARIANT",
    "TracedLinearFp8Provider",
    "fp8_attention_chunk",
    "fp8_attention_cost",
    "fp8_attention_shape",
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


ATTN_COMPONENT = "attn_merged"
"""The chunk component the FP8 attention option replaces (the merged forward's self-attention)."""


def fp8_attention_shape(m: Any, pipe: Any, tp: int, sp: int) -> tuple[tuple[int, ...], int, int, int, int]:
    """``(lqs, blocks, block_tokens, heads, head_dim)`` of one core's merged self-attention call (the shape
    ``perf/e2e/components.py`` prices as :data:`ATTN_COMPONENT`): query groups split over ``sp``, the key
    blocks of the key budget, ``num_heads / tp`` heads."""
    from perf.e2e.chunk import steady_forwards

    fwd = steady_forwards(m, pipe, "merged")[0]
    lqs = tuple(math.ceil(lq / sp) for _, lq, _ in fwd.attention)
    nb = max(math.ceil(lk / fwd.block_tokens) for _, _, lk in fwd.attention)
    return lqs, nb, fwd.block_tokens, m.num_heads // tp, m.head_dim


@cache
def fp8_attention_cost(
    lqs: tuple[int, ...], blocks: int, block_tokens: int, heads: int, head_dim: int, fp8: bool = True
) -> Any:
    """:class:`perf.e2e.kernels.KernelCost` of one ``attention_block_table_kernel`` call, bf16 inputs,
    with the FP8 option (``fp8``, a ``v_scale [1, heads, head_dim]`` input) or without it; traced
    trace-only as :meth:`perf.e2e.kernels.TracedKernels.attention_groups` traces it (one key source, at
    most 3 heads traced and scaled, the guard's fast path) and priced by cost model v2 at both ends
    (**modelled**)."""
    import ml_dtypes
    import numpy as np

    from nki_kernels.attention_block_table import attention_block_table_kernel
    from nki_kernels.emulator import TensorSpec, run
    from nki_kernels.emulator.cost import profile_range
    from perf.e2e.kernels import _profile_cost

    h = max(x for x in range(1, 4) if heads % x == 0)
    bf = ml_dtypes.bfloat16
    q = TensorSpec((1, sum(lqs), h, head_dim), bf)
    src = [TensorSpec((1, blocks * block_tokens, h, head_dim), bf)]
    table = TensorSpec((len(lqs), blocks, 2), np.int32)
    kw: dict[str, Any] = {"v_scale": TensorSpec((1, h, head_dim), "float32")} if fp8 else {}
    args = (
        attention_block_table_kernel,
        q,
        src,
        src,
        table,
        lqs,
        block_tokens,
        1 / math.sqrt(head_dim),
        False,
    )
    _, tr = run(*args, trace_only=True, keep_events=True, **kw)
    lo, hi = profile_range(tr, schedule=True)
    flops = 4 * sum(lqs) * blocks * block_tokens * heads * head_dim
    what = (
        "traced block table"
        + (" fp8" if fp8 else "")
        + (f" at {h} heads x {heads // h}" if h < heads else "")
    )
    return _profile_cost(lo, hi, flops, what, heads // h)


def fp8_attention_chunk(chunk: Any, m: Any, pipe: Any) -> Any:
    """``chunk`` (a merged :class:`perf.e2e.chunk.ChunkModel`) with its :data:`ATTN_COMPONENT` priced as the
    FP8 attention kernel at the chunk's end (the component's time per call replaced; **modelled**)."""
    if not any(c.name == ATTN_COMPONENT for c in chunk.components):
        raise ValueError(f"fp8_attention_chunk: the chunk has no {ATTN_COMPONENT!r} component")
    cost = fp8_attention_cost(*fp8_attention_shape(m, pipe, chunk.tp, chunk.sp))
    comps = tuple(
        replace(c, time_s=cost.at(chunk.end), source=cost.source) if c.name == ATTN_COMPONENT else c
        for c in chunk.components
    )
    return replace(chunk, components=comps)


def _attention_line(r: Any) -> list[str]:
    """The targets-table row of the frame-rate target with FP8 attention (merged chunk)."""
    from perf.e2e.params import ENDS as ends

    if ("merged", "pessimistic") not in r.chunks or "traced" not in r.kernels_name:
        return []  # the FP8 kernel's trace is compared with the traced bf16 one only
    c0 = r.chunk("merged", "pessimistic")
    lqs, nb, t, *_ = fp8_attention_shape(r.model, r.pipe, c0.tp, c0.sp)
    if nb * t < FP8_MIN_KEYS or not any(c.name == ATTN_COMPONENT for c in c0.components):
        return []  # the kernels' FP8 pass needs a second full key chunk (ops.attention_block_table's rule)
    prm = r.params
    ch = {e: fp8_attention_chunk(r.chunk("merged", e), r.model, r.pipe) for e in ends}
    a8 = {e: ch[e].by_group().get("attention", 0.0) * 1e3 for e in ends}
    a16 = {e: r.chunk("merged", e).by_group().get("attention", 0.0) * 1e3 for e in ends}
    ok = {e: ch[e].headroom() >= prm.target_headroom for e in ends}
    cost = fp8_attention_cost(*fp8_attention_shape(r.model, r.pipe, c0.tp, c0.sp))
    busy = sorted(cost.engine_busy_s.items(), key=lambda kv: -kv[1])[:2]
    bound = ", ".join(f"{e} {t * 1e3:.2f} ms" for e, t in busy)
    lo, hi = ch["pessimistic"], ch["optimistic"]
    return [
        f"| >= {prm.target_fps:.0f} fps with FP8 attention (option off: {_attn_gate_status()}) | "
        f"{lo.fps:.2f} / {hi.fps:.2f} fps, chunk {lo.chunk_s * 1e3:.0f} / {hi.chunk_s * 1e3:.0f} ms, "
        f"attention {a8['pessimistic']:.0f} / {a8['optimistic']:.0f} ms (bf16 {a16['pessimistic']:.0f} / "
        f"{a16['optimistic']:.0f}); per call busiest: {bound} | {'yes' if ok['pessimistic'] else 'no'} / "
        f"{'yes' if ok['optimistic'] else 'no'} |"
    ]


def _attn_gate_status() -> str:
    """``tensor gate passes/fails, video gate ...`` of the FP8 attention option (measured)."""
    from perf.fp8_gate import GateConfig, attention_gate
    from perf.fp8_psnr import latest_gates

    t = attention_gate(GateConfig())
    v = latest_gates().get("fp8_attention")
    video = "video gate not run" if v is None else f"video gate {'passes' if v['passed'] else 'fails'}"
    return f"tensor gate {'passes' if t.passed else 'fails'}, {video}; docs/kernels/attention_fp8.md"


def fp8_target_lines(r: Any) -> list[str]:
    """The targets-table rows of the frame-rate target with FP8 linears (empty without the variant) and
    with FP8 attention (:func:`fp8_attention_chunk`; empty without the merged chunk)."""
    return _linear_line(r) + _attention_line(r)


def _linear_line(r: Any) -> list[str]:
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


def main() -> int:
    """Print the FP8 attention kernel against the bf16 one at the Wan per-core merged shape (TP4 x SP2)."""
    from perf.footprint import model_at_resolution, vae_strides
    from rolling_forcing.config import PipelineConfig, get_preset

    m = model_at_resolution(get_preset("wan2.1-1.3b"), 480, 832, vae_strides()[1])
    shape = fp8_attention_shape(m, PipelineConfig(dtype="bfloat16"), 4, 2)
    print(f"merged self-attention per core (lqs, blocks, block_tokens, heads, head_dim) = {shape}")
    for fp8 in (False, True):
        c = fp8_attention_cost(*shape, fp8=fp8)
        busy = ", ".join(
            f"{e} {t * 1e3:.2f}" for e, t in sorted(c.engine_busy_s.items(), key=lambda x: -x[1])
        )
        print(
            f"{'fp8 ' if fp8 else 'bf16'}: {c.at('pessimistic') * 1e3:.2f} / "
            f"{c.at('optimistic') * 1e3:.2f} ms per layer "
            f"(pessimistic / optimistic, modelled); busy ms at the pessimistic end: {busy}"
        )
    return 0


@cache
def _tensor_gates() -> tuple[Any, ...]:
    """The tensor halves of the FP8 gates (seeded random weights, so computed once per process): the
    config, the linears' gates, the KV cache's with / without outlier channels, attention's with / without."""
    from perf.fp8_gate import GateConfig, attention_gate, gate, kv_gate

    cfg, flat = GateConfig(), GateConfig(outlier_frac=0.0)
    return cfg, gate(cfg), kv_gate(cfg), kv_gate(flat), attention_gate(cfg), attention_gate(flat)


def fp8_gate_lines(psnr_rows: str | None = None) -> list[str]:
    """The report's FP8 gates table (**measured**): per option, the tensor half (``perf/fp8_gate.py``:
    Wan2.1 block shapes, random weights, computed once per process by :func:`_tensor_gates`, ~10-25 s of
    CPU) and the decoded-video half on the demo model (the newest rows of ``perf/results/fp8_psnr.jsonl``,
    or ``psnr_rows``, written by ``python -m perf.fp8_psnr --save``)."""
    from perf.fp8_psnr import latest_gates

    cfg, lin, kv, kv0, at, at0 = _tensor_gates()
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
        f"| FP8 attention (P.V in e4m3, self-attention) | {'passes' if at.passed else 'fails'}: error "
        f"{at.err_fp8:.2%} against {at.bound:.2%} ({at.m} tokens); without the outlier channels "
        f"{at0.err_fp8:.2%} against {at0.bound:.2%} ({'passes' if at0.passed else 'fails'}) | "
        f"{vid('fp8_attention')} | off: ScalarE's exp bounds the kernel, so it buys no chunk time "
        "(docs/kernels/attention_fp8.md) |",
        "",
    ]


if __name__ == "__main__":
    raise SystemExit(main())
