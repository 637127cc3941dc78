"""The report's kernel side-by-side table (perf/e2e/report_kernels.py) from bench rows."""

from __future__ import annotations

import json
from pathlib import Path

from perf.e2e.report_kernels import attention_side_by_side_lines


def _row(op: str, variant: str, us: float, lo: float, hi: float, useful: float) -> str:
    extra = {"latency_us_low": lo, "latency_us_high": hi, "useful_flop_pct_high": useful}
    return json.dumps({"op": op, "variant": variant, "latency_us": us, "extra": extra})


def test_side_by_side_uses_the_latest_row_of_each_kernel(tmp_path: Path) -> None:
    f = tmp_path / "b.jsonl"
    f.write_text(
        "\n".join(
            [
                _row("attention", "flash_fused_lnc2", 99_000, 1, 2, 1.0),  # superseded below
                _row("attention", "flash_fused_lnc2", 70_800, 69_900, 72_100, 41.5),
                _row("attention_cte_harness", "wan_lnc2", 165_100, 81_500, 341_700, 8.8),
            ]
        )
    )
    lines = attention_side_by_side_lines(str(f))
    assert len(lines) == 3  # header, rule, the one shape with both rows
    assert lines[2].endswith("| 70.8 [69.9, 72.1] | 165.1 [81.5, 341.7] | 41.5 % / 8.8 % |")


def test_no_rows_says_so(tmp_path: Path) -> None:
    assert "no attention" in attention_side_by_side_lines(str(tmp_path / "missing.jsonl"))[0]
