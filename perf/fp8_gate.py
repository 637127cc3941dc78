"""The FP8 linear error gate, first half: per linear of one Wan2.1-1.3B block, random
weights at the checkpoint's initialisation and activations with realistic statistics, the error of the FP8
path against the bf16 path must stay within ``factor x`` the bf16 path's own error against fp32 plus a
stated floor.  All figures are **measured** (CPU, torch) relative errors.

Paths (per linear ``y = x @ w + b``):

* fp32: ``x``, ``w``, ``b`` fp32, fp32 matmul (the baseline);
* bf16: ``x`` and ``w`` rounded to bf16, fp32 accumulation, one rounding to bf16 (``reference.linear``,
  what ``ops.linear`` computes);
* fp8: the bf16 weights quantised per output channel (``quantize_weight_fp8``), the bf16 activations per
  token, fp32 accumulation and scaling, bf16 output (``reference.linear.linear_fp8``, which the kernel
  reproduces up to the fp32 accumulation order: ``tests/test_kernel_linear_fp8.py``).

Error = ``||y_path - y_baseline||_2 / ||y_baseline||_2`` over the whole output: ``err_bf16`` = bf16 vs
fp32, ``err_fp8`` = fp8 vs bf16.  Pass: ``err_fp8 <= factor * err_bf16 + floor``.  The floor is stated
before measuring: ``2**-7`` (relative), the bf16 floor of ``tests/numerics.py`` for unit-scale outputs.

Weights (Wan2.1's ``WanModel.init_weights``, github.com/Wan-Video/Wan2.1 ``wan/modules/model.py``): every
block linear ``xavier_uniform_`` with zero bias; the text-embedding MLP ``normal_(std=0.02)``.
Activations: the block is run in fp32 on ``tokens`` tokens: ``h ~ N(0, 1)`` with ``outlier_frac`` of the
channels scaled by ``outlier_scale`` (the channel outliers diffusion transformers are known for), adaLN
modulation ``LN(h) * (1 + scale) + shift`` with ``scale, shift ~ N(0, modulation_std^2)`` per channel, q/k
RMSNorm and softmax attention over 12 heads (self) and over ``text_tokens`` text tokens (cross; the text
context is the text-embedding MLP of ``N(0, 1)`` 4096-d features), residuals, FFN with tanh-GELU: every
linear sees the input the block hands it.

The FP8 KV cache gets the same rule on the block's self-attention output (:func:`kv_gate`): ``err_bf16`` =
attention of bf16-rounded q, k, v (fp32 softmax, bf16 output) against fp32; ``err_fp8`` = the same with
K and V through the FP8 cache's per-token-and-head round trip (``rolling_forcing.fp8.kv_fp8_roundtrip``)
against the bf16 one.

The FP8 attention option gets it on the block's self-attention at ``attn_tokens`` tokens
(:func:`attention_gate`; 4,680 = one Wan block of 3 latent frames, so the keys span 5 chunks of 1,024 and
the per-tile offset of the first chunk is exercised): ``err_fp8`` = ``reference.attention_fp8.attention``
(P.V in e4m3, what the kernels compute: tests/test_attention_fp8.py) of the bf16 q, k, v against the bf16
attention.

``python -m perf.fp8_gate --save`` appends every row (**measured**) to ``perf/results/fp8_gate.jsonl``.

The gates' second half (decoded-video PSNR >= 35 dB against the bf16 stream on the trained demo model) is
:mod:`perf.fp8_psnr` (``python -m perf.fp8_psnr``).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from functools import cache

import torch

from reference.linear import linear, linear_fp8, quantize_weight_fp8

__all__ = ["GateConfig", "LinearGate", "attention_gate", "block_linears", "gate", "gate_rows", "kv_gate",
           "linear_gate"]  # fmt: skip


@dataclass(frozen=True)
class GateConfig:
    """Inputs of the gate (defaults: Wan2.1-1.3B, 1,024 tokens, stated floor and factor)."""

    tokens: int = 1024
    text_tokens: int = 512
    dim: int = 1536
    ffn_dim: int = 8960
    heads: int = 12
    text_dim: int = 4096
    outlier_frac: float = 0.01
    outlier_scale: float = 20.0
    modulation_std: float = 0.5
    factor: float = 2.0
    floor: float = 2.0**-7
    seed: int = 0
    attn_tokens: int = 4680

    def __post_init__(self) -> None:
        for name in ("tokens", "text_tokens", "dim", "ffn_dim", "heads", "text_dim", "seed", "attn_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "seed" else 1):
                raise ValueError(f"GateConfig.{name} must be a positive int, got {v!r}")
        if self.dim % self.heads:
            raise ValueError(f"GateConfig.dim={self.dim} must be a multiple of heads={self.heads}")
        if not 0 <= self.outlier_frac < 1 or self.outlier_scale <= 0 or self.modulation_std < 0:
            raise ValueError("GateConfig: outlier_frac in [0, 1), outlier_scale > 0, modulation_std >= 0")
        if self.factor <= 0 or self.floor < 0:
            raise ValueError(f"GateConfig: factor > 0 and floor >= 0, got {self.factor}, {self.floor}")


@dataclass(frozen=True)
class LinearGate:
    """One linear's gate result (errors **measured**, relative L2 over the output)."""

    name: str
    m: int
    k: int
    n: int
    err_bf16: float
    err_fp8: float
    bound: float

    @property
    def passed(self) -> bool:
        return self.err_fp8 <= self.bound

    @property
    def ratio(self) -> float:
        """``err_fp8 / err_bf16``."""
        return self.err_fp8 / self.err_bf16 if self.err_bf16 > 0 else math.inf


def _xavier(k: int, n: int, g: torch.Generator) -> torch.Tensor:
    """``weight_t [K, N]`` of ``nn.init.xavier_uniform_`` on an ``nn.Linear(K, N)`` weight."""
    a = math.sqrt(6.0 / (k + n))
    return (torch.rand(k, n, generator=g) * 2 - 1) * a


def _rms(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _ln(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), eps=eps)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    def split(t: torch.Tensor) -> torch.Tensor:
        return t.view(t.shape[0], heads, -1).transpose(0, 1)

    y = torch.nn.functional.scaled_dot_product_attention(split(q), split(k), split(v))
    return y.transpose(0, 1).reshape(q.shape[0], -1)


def _hidden(cfg: GateConfig, g: torch.Generator) -> torch.Tensor:
    """The block's input ``[tokens, dim]``: ``N(0, 1)`` with ``outlier_frac`` of the channels (a random
    set) scaled by ``outlier_scale``."""
    ch = torch.ones(cfg.dim)
    ch[torch.randperm(cfg.dim, generator=g)[: round(cfg.outlier_frac * cfg.dim)]] = cfg.outlier_scale
    return torch.randn(cfg.tokens, cfg.dim, generator=g) * ch


def block_linears(cfg: GateConfig) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """``[(name, x [M, K] fp32, weight_t [K, N] fp32)]`` for every linear of one Wan block, the inputs
    computed by running the block in fp32 (module docstring); biases are zero (Wan's init)."""
    g = torch.Generator().manual_seed(cfg.seed)
    d, f, h = cfg.dim, cfg.ffn_dim, cfg.heads
    w = {n: _xavier(d, d, g) for n in ("q", "k", "v", "o", "cq", "ck", "cv", "co")}
    w["up"], w["down"] = _xavier(d, f, g), _xavier(f, d, g)
    hid = _hidden(cfg, g)
    sd = cfg.modulation_std
    scale, shift, scale_ff, shift_ff = (torch.randn(d, generator=g) * sd for _ in range(4))
    t5 = torch.randn(cfg.text_tokens, cfg.text_dim, generator=g)
    te1 = torch.randn(cfg.text_dim, d, generator=g) * 0.02
    te2 = torch.randn(d, d, generator=g) * 0.02
    ctx = torch.nn.functional.gelu(t5 @ te1, approximate="tanh") @ te2
    out: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    xm = _ln(hid) * (1 + scale) + shift
    out += [("self_q", xm, w["q"]), ("self_k", xm, w["k"]), ("self_v", xm, w["v"])]
    y = _attend(_rms(xm @ w["q"]), _rms(xm @ w["k"]), xm @ w["v"], h)
    out.append(("self_o", y, w["o"]))
    x1 = hid + y @ w["o"]
    xc = _ln(x1)
    out += [("cross_q", xc, w["cq"]), ("cross_k", ctx, w["ck"]), ("cross_v", ctx, w["cv"])]
    yc = _attend(_rms(xc @ w["cq"]), _rms(ctx @ w["ck"]), ctx @ w["cv"], h)
    out.append(("cross_o", yc, w["co"]))
    x2 = x1 + yc @ w["co"]
    xf = _ln(x2) * (1 + scale_ff) + shift_ff
    out.append(("ffn_up", xf, w["up"]))
    out.append(("ffn_down", torch.nn.functional.gelu(xf @ w["up"], approximate="tanh"), w["down"]))
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def linear_gate(name: str, x: torch.Tensor, weight_t: torch.Tensor, cfg: GateConfig) -> LinearGate:
    """The gate of one linear (``x [M, K]``, ``weight_t [K, N]`` fp32; zero bias)."""
    y32 = x @ weight_t
    xb, wb = x.to(torch.bfloat16), weight_t.to(torch.bfloat16)
    ybf = linear(xb, wb)
    wq, ws = quantize_weight_fp8(wb)
    y8 = linear_fp8(xb, wq, ws)
    eb, e8 = _rel(ybf, y32), _rel(y8, ybf)
    m, k = x.shape
    return LinearGate(name, m, k, weight_t.shape[1], eb, e8, cfg.factor * eb + cfg.floor)


@cache
def gate(cfg: GateConfig = GateConfig()) -> tuple[LinearGate, ...]:
    """Every linear's :class:`LinearGate` for one block (cached per config; ~10 s of CPU at the
    defaults)."""
    return tuple(linear_gate(n, x, w, cfg) for n, x, w in block_linears(cfg))


@cache
def kv_gate(cfg: GateConfig = GateConfig()) -> LinearGate:
    """The FP8 KV cache's tensor gate (module docstring) on the block's self-attention, as a
    :class:`LinearGate` named ``kv_cache`` (``m`` = tokens, ``k`` = keys, ``n`` = dim)."""
    from rolling_forcing.fp8 import kv_fp8_roundtrip

    g = torch.Generator().manual_seed(cfg.seed)
    d, h = cfg.dim, cfg.heads
    wq, wk, wv = (_xavier(d, d, g) for _ in range(3))
    xm = _ln(_hidden(cfg, g)) * (1 + torch.randn(d, generator=g) * cfg.modulation_std)
    q, k, v = _rms(xm @ wq), _rms(xm @ wk), xm @ wv
    y32 = _attend(q, k, v, h)

    def bf(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.bfloat16).float()

    def kv8(t: torch.Tensor) -> torch.Tensor:  # [T, dim] -> per token and head round trip
        return kv_fp8_roundtrip(t.to(torch.bfloat16).view(1, t.shape[0], h, -1)).float().reshape(t.shape)

    ybf = bf(_attend(bf(q), bf(k), bf(v), h))
    y8 = bf(_attend(bf(q), kv8(k), kv8(v), h))
    eb, e8 = _rel(ybf, y32), _rel(y8, ybf)
    return LinearGate("kv_cache", cfg.tokens, cfg.tokens, d, eb, e8, cfg.factor * eb + cfg.floor)


def _self_qkv(cfg: GateConfig, tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The block's self-attention q, k, v ``[tokens, dim]`` fp32 (:func:`kv_gate`'s recipe at ``tokens``)."""
    g = torch.Generator().manual_seed(cfg.seed)
    d = cfg.dim
    wq, wk, wv = (_xavier(d, d, g) for _ in range(3))
    big = GateConfig(**{**cfg.__dict__, "tokens": tokens})
    xm = _ln(_hidden(big, g)) * (1 + torch.randn(d, generator=g) * cfg.modulation_std)
    return _rms(xm @ wq), _rms(xm @ wk), xm @ wv


@cache
def attention_gate(cfg: GateConfig = GateConfig()) -> LinearGate:
    """The FP8 attention option's tensor gate (module docstring) as a :class:`LinearGate` named
    ``fp8_attention`` (``m`` = ``k`` = ``attn_tokens``, ``n`` = dim); ~20 s of CPU."""
    from reference.attention import attention as ref_attention
    from reference.attention_fp8 import attention as ref_fp8

    t, h = cfg.attn_tokens, cfg.heads
    q, k, v = (x.view(1, t, h, -1) for x in _self_qkv(cfg, t))
    y32 = ref_attention(q, k, v)
    qb, kb, vb = (x.to(torch.bfloat16) for x in (q, k, v))
    ybf, y8 = ref_attention(qb, kb, vb), ref_fp8(qb, kb, vb)
    assert isinstance(y32, torch.Tensor) and isinstance(ybf, torch.Tensor) and isinstance(y8, torch.Tensor)
    eb, e8 = _rel(ybf, y32), _rel(y8, ybf)
    return LinearGate("fp8_attention", t, t, cfg.dim, eb, e8, cfg.factor * eb + cfg.floor)


def gate_rows(cfg: GateConfig = GateConfig()) -> list:
    """Every gate of this module as **measured** :class:`perf.runner.BenchRow` s (op = the option, variant
    = the linear / tensor; with and without the outlier channels for the KV cache and attention)."""
    from perf.runner import BenchRow

    no_out = GateConfig(**{**cfg.__dict__, "outlier_frac": 0.0})
    items = [("fp8_linears", r, cfg) for r in gate(cfg)]
    items += [("fp8_kv_cache", kv_gate(c), c) for c in (cfg, no_out)]
    items += [("fp8_attention", attention_gate(c), c) for c in (cfg, no_out)]
    rows = []
    for op, r, c in items:
        conf = {"name": r.name, "m": r.m, "k": r.k, "n": r.n, "outlier_frac": c.outlier_frac, "seed": c.seed}
        extra = {"err_bf16": r.err_bf16, "err_fp8": r.err_fp8, "bound": r.bound, "passed": r.passed,
                 "factor": c.factor, "floor": c.floor}  # fmt: skip
        rows.append(BenchRow(op, r.name, conf, "measured", extra=extra))
    return rows


def format_gate(rows: tuple[LinearGate, ...], cfg: GateConfig) -> str:
    """A markdown table of :func:`gate`'s rows."""
    lines = [
        f"FP8 linear gate (measured, relative L2; pass: err_fp8 <= {cfg.factor:g} x err_bf16 + "
        f"{cfg.floor:.4g}; {cfg.tokens} tokens, seed {cfg.seed})",
        "",
        "| linear | M x K x N | err bf16 vs fp32 | err fp8 vs bf16 | ratio | bound | gate |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.name} | {r.m} x {r.k} x {r.n} | {r.err_bf16:.2e} | {r.err_fp8:.2e} | {r.ratio:.1f} | "
            f"{r.bound:.2e} | {'pass' if r.passed else 'FAIL'} |"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The command's arguments (rows are written only with ``--save``)."""
    ap = argparse.ArgumentParser(description="FP8 tensor gates on Wan2.1-1.3B block shapes (measured)")
    ap.add_argument("--save", action="store_true", help="append the rows to perf/results/fp8_gate.jsonl")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = GateConfig()
    no_out = GateConfig(outlier_frac=0.0)
    print(format_gate((*gate(cfg), kv_gate(cfg), attention_gate(cfg)), cfg))
    print("\nWithout the outlier channels (outlier_frac = 0):\n")
    print(format_gate((kv_gate(no_out), attention_gate(no_out)), no_out))
    if args.save:
        from perf.runner import append_rows

        append_rows(gate_rows(cfg), "fp8_gate")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
