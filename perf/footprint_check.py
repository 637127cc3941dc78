"""The HBM footprint model checked against what the sharded CPU stream allocates.

``perf.footprint`` is arithmetic (*modelled*); this runs the TP x SP sharded stream
(:class:`sharding.pipeline.ShardedRollingForcingPipeline`, gloo ranks on this CPU) at small presets and
compares, item by item, the bytes every rank actually holds (*measured*: ``nbytes`` of the tensors the
rank allocated, reported by :class:`sharding.rank_stream.RankStream`) with :func:`perf.footprint.footprint`
at the same model, plan, dtype and KV-cache layout:

* ``dit_weights``: the rank's model parameters (replicated on every rank);
* ``kv_cache``: its self-attention k/v buffers, all layers (SP-sharded: its share of every block);
* ``kv_gather_buffer``: the largest whole-key-range layer it gathered (SP-sharded cache only);
* ``text_kv``: its cross-attention k/v (all heads, the prompt padded to ``text_len``; ``sp_compact``: its
  token share);
* ``text_kv_gather_buffer``: the largest whole text k/v layer it gathered (``sp_compact`` only).

Per core is the busiest rank; per chip the sum over ranks. Not checked: ``activations`` (the CPU
reference ops allocate temporaries, e.g. whole score matrices, that the device kernels never
materialise, so CPU peak memory says nothing about HBM) and the VAE items.

Run: ``python -m perf.footprint_check`` (tiny and mid presets, TP4xSP2 on 8 ranks = the Wan plan, the
three layouts; a minute or two on 2 cores); ``--save`` appends the rows (:class:`perf.runner.BenchRow`, one
per item and configuration, sharing a ``run_id``) to ``perf/results/footprint_check.jsonl``, whose newest run
``python -m perf.e2e`` prints in the report.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from perf.footprint import footprint
from perf.runner import BenchRow, append_rows, read_rows, results_path
from rolling_forcing.config import ModelConfig, PipelineConfig, get_preset
from rolling_forcing.model import CausalWanModel

__all__ = ["CheckRow", "measure", "check", "latest_rows", "ROWS_NAME", "ITEMS", "LAYOUTS"]

ROWS_NAME = "footprint_check"
"""``perf/results/footprint_check.jsonl``: one :class:`~perf.runner.BenchRow` per item and configuration."""
ITEMS = ("dit_weights", "kv_cache", "kv_gather_buffer", "text_kv", "text_kv_gather_buffer")
_MEASURED_KEY = {
    "dit_weights": "weight_bytes",
    "kv_cache": "kv_bytes",
    "kv_gather_buffer": "kv_gather_bytes",
    "text_kv": "text_kv_bytes",
    "text_kv_gather_buffer": "text_gather_bytes",
}
LAYOUTS = ("sp_sharded", "replicated", "sp_compact")
"""The sharded stream's KV-cache layouts the command checks (``sharding.kv_shard.KV_CACHE_LAYOUTS``)."""


@dataclass(frozen=True)
class CheckRow:
    """One footprint item at one configuration: measured (CPU allocations) vs modelled (formula) bytes."""

    preset: str
    plan: str
    dtype: str
    kv_cache: str
    item: str
    measured_per_core: int
    modelled_per_core: int
    measured_per_chip: int
    modelled_per_chip: int

    @property
    def exact(self) -> bool:
        return (self.measured_per_core, self.measured_per_chip) == (
            self.modelled_per_core,
            self.modelled_per_chip,
        )

    def bench_row(self, run_id: str) -> BenchRow:
        """As a measured :class:`~perf.runner.BenchRow` (``memory_bytes`` = measured per core)."""
        cfg = {"preset": self.preset, "plan": self.plan, "dtype": self.dtype, "kv_cache": self.kv_cache}
        extra = {
            "modelled_per_core": self.modelled_per_core,
            "measured_per_chip": self.measured_per_chip,
            "modelled_per_chip": self.modelled_per_chip,
            "equal": self.exact,
            "run_id": run_id,
        }
        return BenchRow(
            ROWS_NAME, self.item, cfg, "measured", memory_bytes=self.measured_per_core, extra=extra
        )

    @classmethod
    def from_bench_row(cls, r: BenchRow) -> CheckRow:
        c, e = r.config, r.extra
        assert r.memory_bytes is not None
        return cls(
            c["preset"], c["plan"], c["dtype"], c["kv_cache"], r.variant, int(r.memory_bytes),
            int(e["modelled_per_core"]), int(e["measured_per_chip"]), int(e["modelled_per_chip"]),
        )  # fmt: skip


def _model_cfg(preset: str | ModelConfig) -> ModelConfig:
    return preset if isinstance(preset, ModelConfig) else get_preset(preset)


def measure(
    preset: str | ModelConfig,
    *,
    cores: int,
    tp: int | None = None,
    kv_cache: str = "sp_sharded",
    dtype: str = "bfloat16",
    num_blocks: int | None = None,
    seed: int = 0,
) -> tuple[str, list[dict[str, int]]]:
    """Run a ``num_blocks`` sharded stream of ``preset`` (random weights in ``dtype``) on ``cores`` gloo
    ranks (None: ``window_blocks + 1``, the shortest stream that fills and rolls the ring); return the plan
    name and every rank's allocation report (bytes, *measured*)."""
    from sharding.pipeline import ShardedRollingForcingPipeline  # on use: spawns ranks, imports gloo

    m = _model_cfg(preset)
    pipe = PipelineConfig(dtype=dtype)
    model = CausalWanModel(m).init_random(seed).eval().to(pipe.torch_dtype)
    sharded = ShardedRollingForcingPipeline(model, m, pipe, cores=cores, tp=tp, kv_cache=kv_cache)
    g = torch.Generator().manual_seed(seed)
    text = torch.randn(1, m.text_len, m.text_dim, generator=g).to(pipe.torch_dtype)
    nb = pipe.window_blocks + 1 if num_blocks is None else num_blocks
    for _ in sharded.stream(text, nb, generator=g):
        pass
    assert sharded.last_results is not None
    return sharded.plan.name, [{k: int(r[v]) for k, v in _MEASURED_KEY.items()} for r in sharded.last_results]


def check(
    preset: str | ModelConfig,
    *,
    cores: int,
    tp: int | None = None,
    kv_cache: str = "sp_sharded",
    dtype: str = "bfloat16",
) -> list[CheckRow]:
    """Measured vs modelled bytes of every item of :data:`ITEMS` at ``preset`` (a preset name or a
    :class:`~rolling_forcing.config.ModelConfig`); an item the model does not have (no gather buffer for
    a replicated cache, no text gather buffer outside ``sp_compact``) is modelled as 0."""
    plan_name, ranks = measure(preset, cores=cores, tp=tp, kv_cache=kv_cache, dtype=dtype)
    from sharding.pipeline import pipeline_plan

    m, pipe = _model_cfg(preset), PipelineConfig(dtype=dtype)
    plan = pipeline_plan(m, pipe, cores, tp=tp)
    b = pipe.torch_dtype.itemsize
    fp = footprint(
        m, pipe, tp=plan.tp, sp=plan.sp, kv_bytes=b, weight_bytes=b, act_bytes=b, kv_cache=kv_cache,
        gather_buffers=1,
    )  # fmt: skip
    names = {i.name for i in fp.items}
    rows = []
    for item in ITEMS:
        got = [r[item] for r in ranks]
        # an item the model lacks (no gather buffer for a replicated cache): the ranks must hold nothing
        core, chip = (fp.item(item).per_core, fp.item(item).per_chip) if item in names else (0, 0)
        rows.append(CheckRow(m.name, plan_name, dtype, kv_cache, item, max(got), core, sum(got), chip))
    return rows


def latest_rows(path: str | Path | None = None) -> list[CheckRow]:
    """The rows of the newest run (largest ``run_id``) saved in ``path`` (default
    ``perf/results/footprint_check.jsonl``); empty if none."""
    p = Path(path) if path is not None else results_path(ROWS_NAME)
    if not p.exists():
        return []
    rows = [r for r in read_rows(p) if r.op == ROWS_NAME and r.status == "ok"]
    if not rows:
        return []
    last = max(str(r.extra["run_id"]) for r in rows)
    return [CheckRow.from_bench_row(r) for r in rows if r.extra["run_id"] == last]


def table_lines(rows: list[CheckRow]) -> list[str]:
    """Markdown table of ``rows`` (bytes as MB with 3 decimals; exact = measured equals modelled)."""
    out = [
        "| preset | plan | dtype | KV cache | item | measured per core MB | modelled per core MB "
        "| measured per chip MB | modelled per chip MB | equal |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r.preset} | {r.plan} | {r.dtype} | {r.kv_cache} | {r.item} "
            f"| {r.measured_per_core / 1e6:.3f} | {r.modelled_per_core / 1e6:.3f} "
            f"| {r.measured_per_chip / 1e6:.3f} | {r.modelled_per_chip / 1e6:.3f} "
            f"| {'yes' if r.exact else 'NO'} |"
        )
    return out


def build_parser() -> argparse.ArgumentParser:
    """The command's arguments (a test checks the default writes nothing tracked: rows only with
    ``--save``)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", nargs="+", default=["tiny", "mid"])
    ap.add_argument("--cores", type=int, default=8)
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--save", action="store_true", help=f"append the rows to perf/results/{ROWS_NAME}.jsonl")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    run_id = datetime.now(timezone.utc).isoformat(timespec="seconds")
    t0 = time.perf_counter()
    rows = [
        r
        for preset in a.presets
        for layout in LAYOUTS
        for r in check(preset, cores=a.cores, tp=a.tp, kv_cache=layout, dtype=a.dtype)
    ]
    wall = time.perf_counter() - t0
    print("\n".join(table_lines(rows)))
    bad = [r for r in rows if not r.exact]
    print(f"{len(rows) - len(bad)} of {len(rows)} items equal (measured {wall:.1f} s wall)")
    if a.save:
        print(f"rows appended to {append_rows([r.bench_row(run_id) for r in rows], ROWS_NAME)}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
