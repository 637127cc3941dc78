"""Per-method end-to-end rows: the modelled steady-state cost of each streaming loop on trn2.

For every method of :mod:`rolling_forcing.methods` one steady-state chunk (one new 3-latent block = 12
pixel frames) is modelled by :func:`perf.e2e.chunk.chunk_model` with that method's forwards
(:func:`method_forwards`) and the VAE decode of the block, at both ends of the parameter ranges. Next to
it: the method's persistent HBM (weights per core, its KV buffer, text k/v, VAE weights and workspace;
activations left out for every method alike) and the method's *published* GPU figure. Every Trainium
figure is **modelled**.

Steady state per method (keys at 480x832, 1560 tokens per latent frame):

* ``rolling-forcing``: the merged forward (update 3 + window 15 frames; 21-frame keys).
* ``self-forcing`` / ``causvid``: 4 / 3 denoise forwards + 1 cache-update forward, each 3 query frames,
  keys = the 21-frame window (the original's rolling option; its released 21-frame stream averages fewer
  keys and stops there).
* ``longlive``: 4 + 1 forwards with 12-frame keys (sink 3 + local 9); a prompt switch adds one re-cache
  forward (not in the steady state).

Published GPU figures (not comparable hardware; each from its public source): :data:`PUBLISHED_GPU`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from perf.e2e.chunk import ChunkModel, chunk_model, steady_forwards
from perf.e2e.components import Forward
from perf.e2e.params import ENDS, E2EParams
from perf.footprint import footprint
from rolling_forcing.config import ModelConfig, PipelineConfig
from rolling_forcing.methods import METHODS, StreamMethod

__all__ = [
    "PUBLISHED_GPU",
    "MethodRow",
    "method_bench_rows",
    "method_forwards",
    "method_hbm_bytes",
    "method_rows",
    "method_table",
]

PUBLISHED_GPU: dict[str, tuple[str, str]] = {
    "rolling-forcing": (
        "16 fps, single GPU (model not stated)",
        "arXiv 2509.25161 abstract; github.com/TencentARC/RollingForcing README.md@a1477d0",
    ),
    "self-forcing": (
        "17.0 fps, single GPU (chunk-wise)",
        "Self-Forcing paper Table 1, as listed by github.com/NVlabs/LongLive index.html@2dec08a (page)",
    ),
    "causvid": ("9.4 fps, single GPU", "github.com/tianweiy/CausVid README.md@ca21150"),
    "longlive": ("20.7 fps, one H100 (24.8 with FP8)", "github.com/NVlabs/LongLive README.md@e52d9ef (v1.0)"),
}


def method_forwards(
    m: ModelConfig, method: StreamMethod, *, batched: bool = False, static: bool = False
) -> list[Forward]:
    """The forwards of one steady-state block of ``method`` (chip-wide token counts).

    ``batched`` (sequential methods): the block's cache update rides with the next block's first denoise
    call in one 6-frame forward (``merged=True`` of the driver), one forward fewer per block.
    ``static`` (``static=True`` of the driver): every call is that 6-frame forward; the calls without an
    update carry a masked update block (its tokens go through every linear layer; its query group has no
    keys, so no attention).
    """
    if not method.sequential:
        return steady_forwards(m, method.pipeline_config(dtype="bfloat16"), "merged")
    blk = method.tokens_per_block(m)
    keys = method.attention_frames * m.tokens_per_frame
    tok = 2 * blk if static else blk
    fwds = [Forward(f"step{k}", tok, (("denoise", blk, keys),)) for k in range(method.steps)]
    if method.cache_update and (batched or static):
        fwds[0] = Forward("batched", 2 * blk, (("update", blk, keys), ("denoise", blk, keys)))
    elif method.cache_update:
        fwds.append(Forward("update", blk, (("update", blk, keys),)))
    return fwds


def method_hbm_bytes(m: ModelConfig, method: StreamMethod, tp: int, sp: int, vae: Any) -> int:
    """Persistent HBM of one chip: weights per core + the method's KV buffer + text k/v + VAE (no
    activations), from :func:`perf.footprint.footprint` with the KV item sized to the method's buffer."""
    p = PipelineConfig(dtype="bfloat16")
    fp = footprint(m, p, tp=tp, sp=sp, vae=vae)
    items = {i.name: i.per_chip for i in fp.items if i.name != "activations"}
    if method.sequential:
        items["kv_cache"] = method.buffer_tokens(m) * m.dim * 2 * m.num_layers * 2
    return sum(items.values())


@dataclass(frozen=True)
class MethodRow:
    """One method (``method``, or ``method+batched`` for the batched cache update): its steady-state
    chunk at each end, forwards per block, persistent HBM, published fps."""

    method: str
    forwards_per_block: int
    chunks: dict[str, ChunkModel]
    hbm_bytes: int
    published: str
    source: str


def method_rows(
    m: ModelConfig,
    *,
    cores: int,
    vae: Any,
    kernels: Any,
    matmul: Any,
    params: E2EParams,
    methods: tuple[str, ...] = tuple(METHODS),
    batched: bool = True,
) -> list[MethodRow]:
    """Modelled rows of ``methods`` on ``cores`` cores (see the module docstring); ``batched`` adds the
    ``<method>+batched`` and ``<method>+static`` rows per sequential method (:func:`method_forwards`)."""
    rows = []
    p = PipelineConfig(dtype="bfloat16")
    kw: dict[str, Any] = {"vae": vae, "kernels": kernels, "matmul": matmul, "params": params}
    for name in methods:
        meth = METHODS[name]
        for var in ("", "batched", "static") if batched and meth.sequential else ("",):
            fwds = method_forwards(m, meth, batched=var == "batched", static=var == "static")
            label = f"{name}+{var}" if var else name
            chunks = {
                end: chunk_model(m, p, cores=cores, variant=label, end=end, forwards=fwds, **kw)
                for end in ENDS
            }
            cm = chunks[ENDS[0]]
            pub, src = PUBLISHED_GPU[name]
            hbm = method_hbm_bytes(m, meth, cm.tp, cm.sp, vae)
            rows.append(MethodRow(label, len(fwds), chunks, hbm, pub, src))
    return rows


def method_table(rows: list[MethodRow]) -> str:
    """Plain-text table: modelled fps at both ends, DiT TFLOP per block, HBM, published GPU figure."""
    head = (
        f"{'method':<22} {'fwd/blk':>7} {'TFLOP/blk':>9} {'fps opt':>8} {'fps pess':>8} {'HBM GB':>7}  "
        "published GPU figure (not trn2)"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        opt, pess = r.chunks["optimistic"], r.chunks["pessimistic"]
        lines.append(
            f"{r.method:<22} {r.forwards_per_block:>7} {opt.dit_flops / 1e12:>9.1f} {opt.fps:>8.1f} "
            f"{pess.fps:>8.1f} {r.hbm_bytes / 1e9:>7.2f}  {r.published}"
        )
    lines.append("fps and HBM: modelled (trn2, one chip); published figures: GPU, from each method's source")
    return "\n".join(lines)


def method_bench_rows(rows: list[MethodRow], m: ModelConfig, height: int, width: int) -> list[Any]:
    """``BenchRow`` s (``op="e2e_method"``, ``kind="modelled"``) of :func:`method_rows`, one per end."""
    from perf.runner import BenchRow

    out = []
    for r in rows:
        for end, cm in r.chunks.items():
            out.append(
                BenchRow(
                    op="e2e_method",
                    variant=f"{r.method}/{end}",
                    config={"preset": m.name, "height": height, "width": width, "cores": cm.cores},
                    kind="modelled",
                    latency_us=cm.chunk_s * 1e6,
                    fps=cm.fps,
                    tensore_util=cm.mfu,
                    memory_bytes=r.hbm_bytes,
                    extra={
                        "end": end,
                        "plan": cm.plan_name,
                        "forwards_per_block": r.forwards_per_block,
                        "dit_tflop_per_block": cm.dit_flops / 1e12,
                        "dit_fps": cm.dit_fps,
                        "published_gpu": r.published,
                        "published_source": r.source,
                    },
                )
            )
    return out
