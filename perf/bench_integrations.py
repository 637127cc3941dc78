"""Measured CPU overhead of the project's attention processor in diffusers' Wan model
(``python -m perf.bench_integrations``).

The same diffusers ``WanTransformer3DModel`` (same weights, same inputs) runs with diffusers' default
``WanAttnProcessor`` (``scaled_dot_product_attention``, diffusers' native backend) and with
:class:`nki_ardiff.integrations.diffusers.NkiWanAttnProcessor` on the ``reference`` backend (the ops'
PyTorch path, the only one that runs at CPU speed; the emulator interprets every instruction and is a
correctness tool, not a timing). The processors are swapped between runs (``set_attn_processor``), the
two alternating ``--rounds`` times after ``--warmup`` untimed calls each, so a drift of the shared machine
falls on both.

Timed, per dtype (fp32, bf16): one self-attention call (``blocks.0.attn1``: projections, q/k RMSNorm,
RoPE, attention, output projection), one cross-attention call (``blocks.0.attn2``, over the text tokens),
the whole model forward, and the attention math alone on the self-attention's q, k, v shape
(``attention_math``: ``scaled_dot_product_attention``, what diffusers' processor dispatches to, against
``ops.attention``), which says how much of the overhead is the reference backend's attention (full fp32
scores; on a trn2 that op is the NKI kernel) rather than the processor's own work.

Figures are *measured* (CPU wall clock, ``--threads`` intra-op threads, median over the rounds); the NKI
rows carry ``overhead_x`` (NKI median / diffusers median) and ``max_abs_diff`` (max |NKI - diffusers| of
that output, a sanity check, not a tolerance test: see tests/test_integrations_diffusers.py for those).

Presets: ``wan1.3b-layer`` (default): one transformer layer of Wan2.1-T2V-1.3B's widths (dim 1536, 12
heads of 128, FFN 8960, text 512 x 4096) on a chunk of 3 latent frames of 30 x 52 (1,170 tokens: a
240 x 416 video, a quarter of 480 x 832's tokens, so a run takes minutes, not tens of minutes, on one
thread); ``quick``: a toy size for a smoke run (seconds).

Nothing tracked is written unless ``--save`` (rows appended to ``perf/results/integrations.jsonl``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from perf.runner import BenchRow, append_rows, print_table

VARIANTS = ("diffusers", "nki_reference")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Preset:
    """A diffusers Wan transformer size and one input: latents ``[1, 16, F, H, W]``, text
    ``[1, Lt, text_dim]``."""

    heads: int
    head_dim: int
    ffn_dim: int
    text_dim: int
    layers: int
    latent: tuple[int, int, int]  # (frames, height, width) of the latents; patch 1 x 2 x 2
    text: int

    @property
    def tokens(self) -> int:
        f, h, w = self.latent
        return f * (h // 2) * (w // 2)


PRESETS = {
    "wan1.3b-layer": Preset(
        heads=12, head_dim=128, ffn_dim=8960, text_dim=4096, layers=1, latent=(3, 30, 52), text=512
    ),
    "quick": Preset(heads=2, head_dim=64, ffn_dim=256, text_dim=64, layers=1, latent=(3, 8, 8), text=16),
}


def build(preset: Preset, dtype: torch.dtype, seed: int = 0) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The model (diffusers' default init, eval, ``dtype``) and its inputs, plus attn1/attn2 call inputs."""
    import diffusers

    torch.manual_seed(seed)
    model: Any = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=preset.heads,
        attention_head_dim=preset.head_dim,
        in_channels=16,
        out_channels=16,
        text_dim=preset.text_dim,
        freq_dim=256,
        ffn_dim=preset.ffn_dim,
        num_layers=preset.layers,
    )
    model = model.to(dtype).eval()
    g = torch.Generator().manual_seed(seed + 1)
    dim = preset.heads * preset.head_dim
    x = torch.randn(1, 16, *preset.latent, generator=g).to(dtype)
    with torch.inference_mode():
        rotary = model.rope(x)
    inputs = {
        "x": x,
        "t": torch.tensor([500.0]),
        "text": torch.randn(1, preset.text, preset.text_dim, generator=g).to(dtype),
        "hs": torch.randn(1, preset.tokens, dim, generator=g).to(dtype),
        "enc": torch.randn(1, preset.text, dim, generator=g).to(dtype),
        "rotary": rotary,
    }
    for name in ("q", "k", "v"):
        inputs[name] = torch.randn(1, preset.tokens, preset.heads, preset.head_dim, generator=g).to(dtype)
    return model, inputs


def _calls(model: torch.nn.Module, inp: dict[str, Any]) -> dict[str, dict[str, Callable[[], torch.Tensor]]]:
    """``{call: {variant: fn}}``. The module calls run whichever processor is installed; ``attention``
    is the attention math alone on the same ``[1, L, H, D]`` q, k, v: what diffusers' processor calls
    (``scaled_dot_product_attention`` on ``[B, H, L, D]`` views) against ``ops.attention``."""
    from nki_kernels import ops

    block: Any = model.blocks[0]  # type: ignore[index]
    q, k, v = inp["q"], inp["k"], inp["v"]
    module_calls: dict[str, Callable[[], torch.Tensor]] = {
        "attn1": lambda: block.attn1(inp["hs"], None, None, inp["rotary"]),
        "attn2": lambda: block.attn2(inp["hs"], inp["enc"]),
        "forward": lambda: model(inp["x"], inp["t"], inp["text"], return_dict=False)[0],
    }
    calls = {name: {v: fn for v in VARIANTS} for name, fn in module_calls.items()}

    def sdpa() -> torch.Tensor:
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        )
        return o.transpose(1, 2)

    def nki() -> torch.Tensor:
        out = ops.attention(q, k, v, backend="reference")
        assert isinstance(out, torch.Tensor)
        return out

    calls["attention"] = {"diffusers": sdpa, "nki_reference": nki}
    return calls


def _use(model: torch.nn.Module, variant: str) -> None:
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    from nki_ardiff.integrations.diffusers import install_nki_attention

    if variant == "diffusers":
        model.set_attn_processor(WanAttnProcessor())  # type: ignore[operator]
    else:
        install_nki_attention(model, backend="reference")


def measure(preset_name: str, dtype_name: str, rounds: int, warmup: int) -> list[BenchRow]:
    """Rows for one preset and dtype: per call (attn1, attn2, forward) one row per variant."""
    preset, dtype = PRESETS[preset_name], DTYPES[dtype_name]
    model, inp = build(preset, dtype)
    calls = _calls(model, inp)
    times: dict[tuple[str, str], list[float]] = {(c, v): [] for c in calls for v in VARIANTS}
    outputs: dict[tuple[str, str], torch.Tensor] = {}
    with torch.inference_mode():
        for call, fns in calls.items():
            for v in VARIANTS:  # untimed warm-up of both, and the outputs compared below
                _use(model, v)
                for _ in range(warmup):
                    outputs[(call, v)] = fns[v]()
            for _ in range(rounds):
                for v in VARIANTS:
                    _use(model, v)
                    t0 = time.perf_counter()
                    fns[v]()
                    times[(call, v)].append((time.perf_counter() - t0) * 1e6)
    config = {
        "preset": preset_name,
        "dtype": dtype_name,
        "tokens": preset.tokens,
        "text_tokens": preset.text,
        "heads": preset.heads,
        "head_dim": preset.head_dim,
        "layers": preset.layers,
        "threads": torch.get_num_threads(),
    }
    rows = []
    for call in calls:
        base = statistics.median(times[(call, "diffusers")])
        for v in VARIANTS:
            ts = times[(call, v)]
            med = statistics.median(ts)
            extra: dict[str, Any] = {"rounds": rounds, "min_us": min(ts), "max_us": max(ts)}
            if v != "diffusers":
                diff = (outputs[(call, v)].double() - outputs[(call, "diffusers")].double()).abs().max()
                extra |= {"overhead_x": med / base, "max_abs_diff": float(diff)}
            rows.append(
                BenchRow(
                    op="attention_math" if call == "attention" else f"wan_{call}",
                    variant=v,
                    config=config,
                    kind="measured",
                    latency_us=med,
                    extra=extra,
                )
            )
    return rows


def summary(rows: list[BenchRow]) -> list[str]:
    """One line per (op, dtype): the measured overhead of the NKI processor."""
    out = []
    for r in rows:
        if r.variant == "diffusers" or r.status != "ok":
            continue
        base = next(
            b
            for b in rows
            if b.variant == "diffusers" and b.op == r.op and b.config == r.config and b.latency_us
        )
        assert r.latency_us is not None and base.latency_us is not None
        ours, theirs = (
            ("ops.attention (reference)", "scaled_dot_product_attention")
            if r.op == "attention_math"
            else ("NKI processor (reference backend)", "diffusers' processor")
        )
        out.append(
            f"measured {r.op} {r.config['dtype']}: {ours} "
            f"{r.latency_us / 1e3:.2f} ms vs {theirs} {base.latency_us / 1e3:.2f} ms = "
            f"x{r.extra['overhead_x']:.2f} ({(r.latency_us - base.latency_us) / 1e3:+.2f} ms), "
            f"max |diff| {r.extra['max_abs_diff']:.2e}"
        )
    return out


def build_parser() -> argparse.ArgumentParser:
    """The command's arguments (nothing tracked is written without ``--save``)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="wan1.3b-layer")
    ap.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=3, help="timed calls per variant, alternating")
    ap.add_argument("--warmup", type=int, default=1, help="untimed calls per variant first")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument(
        "--save",
        action="store_true",
        help="append the rows to perf/results/integrations.jsonl (tracked); default: print only",
    )
    return ap


def main(argv: list[str] | None = None) -> None:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.warmup < 1:
        ap.error(f"--rounds and --warmup must be >= 1, got {args.rounds} and {args.warmup}")
    if args.threads < 1:
        ap.error(f"--threads must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)
    rows = [r for d in args.dtypes for r in measure(args.preset, d, args.rounds, args.warmup)]
    if args.save:
        print(f"rows appended to {append_rows(rows, 'integrations')}")
    print_table(rows)
    for line in summary(rows):
        print(line)


if __name__ == "__main__":
    main()
