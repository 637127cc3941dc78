"""Sharding planner: split one attention layer over NeuronCores as TP (heads) x SP (queries/tokens).

Pure functions only (no torch, no process groups): the planner can run anywhere, including in the CLI.

Layout of a plan with ``tp * sp == num_cores`` ranks (``rank = s * tp + g``):

* everything except attention runs on a *token shard*: the layer input ``[B, L, C]`` is split along L
  into ``num_cores`` near-equal contiguous chunks (weights replicated, never split);
* for attention, an all-to-all inside each TP group (the ``tp`` consecutive ranks sharing ``s``) regroups
  q, k, v ``[B, L_local, H, D]`` from token shards to (head group ``g`` x query shard ``s``), where the
  query shard ``s`` is the union of the TP group's token chunks and head group ``g`` holds
  ``H / tp`` heads;
* k and v are all-gathered inside each SP group (the ``sp`` ranks sharing ``g``, stride ``tp``), so
  every rank attends its local queries over all keys of its heads;
* an inverse all-to-all restores the token shards.

Ulysses is the special case ``tp == num_cores`` (``sp == 1``); pure sequence parallelism with a K/V
gather is ``tp == 1``.

All times and bandwidths here are *modelled* (see :class:`CommModel` for sources), never measured.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = [
    "AttentionShape",
    "CommModel",
    "CommEstimate",
    "Alternative",
    "ShardingPlan",
    "is_legal_group_size",
    "plan",
    "plan_table",
    "main",
]


def is_legal_group_size(n: int) -> bool:
    """True if ``n`` ranks may form one Neuron collective group: 1, 2, 4, 8, 16 or a multiple of 32."""
    return n in (1, 2, 4, 8, 16) or (n > 0 and n % 32 == 0)


@dataclass(frozen=True)
class AttentionShape:
    """Per-layer self-attention shape the communication is modelled at (defaults: Wan2.1-1.3B window).

    ``num_queries``: tokens that pass through the layer (and attend); Rolling Forcing window of 15 latent
    frames x 1,560 tokens = 23,400. ``num_keys``: keys each query attends (sink + cache + window,
    21 frames x 1,560 = 32,760). The new tokens' k/v are part of the ``num_keys``; the cached rest is
    assumed kept per head group and sharded along SP, so the K/V all-gather covers all ``num_keys``.
    ``dtype_bytes``: 2 for bf16 activations.
    """

    num_queries: int = 23_400
    num_keys: int = 32_760
    head_dim: int = 128
    dtype_bytes: int = 2
    batch: int = 1

    def __post_init__(self) -> None:
        for name in ("num_queries", "num_keys", "head_dim", "dtype_bytes", "batch"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"AttentionShape.{name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class CommModel:
    """Alpha-beta model of Trn2 collectives (all figures *modelled*; sources in docs/sharding.md).

    Sources: the AWS Neuron SDK docs (github.com/aws-neuron/aws-neuron-sdk @ 81ce03ae26,
    ``neuron-runtime/explore/intranode-collective-comm.rst`` and ``tools/neuron-sys-tools/nccom-test.rst``):

    * ``fixed_latency_s`` = 10 us: the upper end of the documented 1-10 us collective latency term.
    * ``hop_latency_s`` = 2 us: the upper end of the documented 1-2 us per-hop latency (Ring/KangaRing,
      and across chips 1-2 us per hop).
    * ``intra_chip_bw_Bps`` = 40.7 GB/s: ASSUMPTION. The cost model gives no core-to-core collective
      bandwidth inside one chip; the only measured collective figure it quotes is a 2-rank 32 MiB
      all-reduce at 40.7 GB/s bus bandwidth (nccom-test sample, instance not stated). It is used as a
      conservative per-rank bandwidth. :meth:`optimistic` uses the uncited third-party 400 GB/s
      die-to-die figure instead.
    * ``inter_chip_bw_Bps`` = 40.7 GB/s: same conservative assumption for groups spanning chips (the
      intra-instance NeuronLink is 1,024 GB/s per chip = 128 GB/s per core when all 8 cores send;
      :meth:`optimistic` uses that 128 GB/s).
    * ``cores_per_chip`` = 8 physical NeuronCore-v3 per Trainium2 chip (LNC=1).
    * ``core_peak_flops`` = 79e12: dense BF16 TensorE peak of one NeuronCore-v3 ("use 79 TF per core
      for kernel models", section 1); only used for the attention-compute column of the alternatives.

    Collective times: all-to-all ``fixed + hop + bytes_sent / bw`` (direct/mesh exchange, one step);
    ring all-gather ``fixed + (p - 1) * hop + bytes_received / bw``. A group whose ranks sit on more than
    one chip uses the inter-chip figures.
    """

    fixed_latency_s: float = 10e-6
    hop_latency_s: float = 2e-6
    intra_chip_bw_Bps: float = 40.7e9
    inter_chip_bw_Bps: float = 40.7e9
    cores_per_chip: int = 8
    core_peak_flops: float = 79e12
    name: str = "conservative"

    def __post_init__(self) -> None:
        for attr in ("fixed_latency_s", "hop_latency_s"):
            if getattr(self, attr) < 0:
                raise ValueError(f"CommModel.{attr} must be >= 0, got {getattr(self, attr)!r}")
        for attr in ("intra_chip_bw_Bps", "inter_chip_bw_Bps", "core_peak_flops"):
            if getattr(self, attr) <= 0:
                raise ValueError(f"CommModel.{attr} must be > 0, got {getattr(self, attr)!r}")
        if self.cores_per_chip < 1:
            raise ValueError(f"CommModel.cores_per_chip must be >= 1, got {self.cores_per_chip!r}")

    @classmethod
    def conservative(cls) -> CommModel:
        """The default: every collective at the measured 40.7 GB/s nccom-test bus bandwidth."""
        return cls()

    @classmethod
    def optimistic(cls) -> CommModel:
        """Upper bound: 400 GB/s on chip (uncited third-party die-to-die), 128 GB/s/core across chips."""
        return cls(
            fixed_latency_s=1e-6,
            hop_latency_s=1e-6,
            intra_chip_bw_Bps=400e9,
            inter_chip_bw_Bps=128e9,
            name="optimistic",
        )

    def _bw(self, spans_chips: bool) -> float:
        return self.inter_chip_bw_Bps if spans_chips else self.intra_chip_bw_Bps

    def all_to_all_s(self, group: int, bytes_sent: int, spans_chips: bool) -> float:
        """Modelled time of one all-to-all in a group of ``group`` ranks; ``bytes_sent`` per rank."""
        if group <= 1:
            return 0.0
        return self.fixed_latency_s + self.hop_latency_s + bytes_sent / self._bw(spans_chips)

    def all_gather_s(self, group: int, bytes_received: int, spans_chips: bool) -> float:
        """Modelled time of one ring all-gather in a group of ``group`` ranks."""
        if group <= 1:
            return 0.0
        return (
            self.fixed_latency_s + (group - 1) * self.hop_latency_s + bytes_received / self._bw(spans_chips)
        )


@dataclass(frozen=True)
class CommEstimate:
    """Per-layer communication of the busiest rank (bytes) and its modelled time (seconds).

    ``all_to_all_bytes``: bytes one rank sends in the fused q/k/v all-to-all plus the inverse all-to-all
    of the output. ``all_gather_bytes``: bytes one rank receives in the fused k/v all-gather.
    """

    all_to_all_bytes: int
    all_gather_bytes: int
    all_to_all_s: float
    all_gather_s: float
    collectives: int

    @property
    def total_bytes(self) -> int:
        return self.all_to_all_bytes + self.all_gather_bytes

    @property
    def total_s(self) -> float:
        return self.all_to_all_s + self.all_gather_s


@dataclass(frozen=True)
class Alternative:
    """One candidate layout, chosen or not.

    ``kind``: ``"tpxsp"`` (balanced factorisation family, includes Ulysses ``tp == cores`` and pure SP
    ``tp == 1``), ``"padded-tp"`` (heads zero-padded to a multiple of the cores) or ``"uneven-tp"``
    (heads split unevenly over all cores). ``attention_balance``: useful attention work over
    ``cores x`` the busiest core's work (1.0 = perfectly balanced). ``attention_s``: *modelled* time of
    the busiest core's attention matmuls at :attr:`CommModel.core_peak_flops` (a lower bound that
    shows what padding or an uneven split costs). ``comm`` / ``attention_s`` / ``attention_balance``
    are None when the layout cannot run at all (e.g. illegal group size, does not divide the cores).
    ``reason`` is empty for the chosen plan.
    """

    name: str
    kind: str
    tp: int
    sp: int
    heads_per_core: int
    attention_balance: float | None
    attention_s: float | None
    comm: CommEstimate | None
    chosen: bool
    reason: str


@dataclass(frozen=True)
class ShardingPlan:
    """A balanced TP x SP plan for one attention layer (see module docstring for the rank layout).

    ``rank = s * tp + g``: TP groups are ``tp`` consecutive ranks, SP groups are strided by ``tp``.
    """

    num_heads: int
    num_cores: int
    tp: int
    sp: int
    heads_per_core: int
    shape: AttentionShape
    model: CommModel
    comm: CommEstimate
    alternatives: tuple[Alternative, ...] = field(default=())

    @property
    def world_size(self) -> int:
        return self.tp * self.sp

    @property
    def is_ulysses(self) -> bool:
        return self.tp == self.num_cores

    @property
    def name(self) -> str:
        return _name(self.tp, self.sp, self.num_cores)

    @property
    def comm_bytes_per_layer(self) -> int:
        return self.comm.total_bytes

    @property
    def comm_time_s(self) -> float:
        """Modelled communication time per layer (seconds)."""
        return self.comm.total_s

    def head_group(self, rank: int) -> int:
        """Head group (TP index, ``rank % tp``) of ``rank`` in ``[0, world_size)``; else ``ValueError``."""
        _check_rank(rank, self.world_size)
        return rank % self.tp

    def query_shard(self, rank: int) -> int:
        """Query shard (SP index, ``rank // tp``) of ``rank`` in ``[0, world_size)``; else ``ValueError``."""
        _check_rank(rank, self.world_size)
        return rank // self.tp

    def tp_group_ranks(self, s: int) -> tuple[int, ...]:
        """Ranks of the TP group of query shard ``s`` (the all-to-all group)."""
        return tuple(s * self.tp + g for g in range(self.tp))

    def sp_group_ranks(self, g: int) -> tuple[int, ...]:
        """Ranks of the SP group of head group ``g`` (the K/V all-gather group)."""
        return tuple(s * self.tp + g for s in range(self.sp))


def _check_rank(rank: int, world: int) -> None:
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, {world}), got {rank}")


def _name(tp: int, sp: int, cores: int) -> str:
    if sp == 0:
        return f"TP{tp}"
    if tp == cores and sp == 1 and cores > 1:
        return f"Ulysses TP{tp}xSP1"
    return f"TP{tp}xSP{sp}"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _spans_chips(ranks: Sequence[int], cores_per_chip: int) -> bool:
    return len({r // cores_per_chip for r in ranks}) > 1


def _attention_s(
    heads_per_core: int, queries_per_core: int, shape: AttentionShape, model: CommModel
) -> float:
    """Modelled busiest-core attention matmul time (QK^T and PV, 2 flops per MAC) at TensorE peak."""
    flops = 4 * shape.batch * queries_per_core * shape.num_keys * heads_per_core * shape.head_dim
    return flops / model.core_peak_flops


def _comm_tpxsp(tp: int, sp: int, heads: int, shape: AttentionShape, model: CommModel) -> CommEstimate:
    """Per-layer communication of the balanced layout (``heads`` may include padding heads)."""
    cores = tp * sp
    e = shape.dtype_bytes * shape.batch
    chunk = math.ceil(shape.num_queries / cores)  # tokens per token shard (busiest rank)
    heads_local = heads // tp
    # one rank sends its chunk of the heads of the other tp-1 head groups, for q, k, v (fused) and
    # for the output (inverse all-to-all).
    a2a_one = chunk * (tp - 1) * heads_local * shape.head_dim * e
    a2a_bytes = 4 * a2a_one
    # k and v (fused): receive the other sp-1 key shards of the local heads.
    key_shard = math.ceil(shape.num_keys / sp)
    gather_bytes = 2 * (sp - 1) * key_shard * heads_local * shape.head_dim * e
    tp_spans = _spans_chips(range(tp), model.cores_per_chip)
    sp_spans = _spans_chips(range(0, cores, tp), model.cores_per_chip)
    a2a_s = model.all_to_all_s(tp, 3 * a2a_one, tp_spans) + model.all_to_all_s(tp, a2a_one, tp_spans)
    gather_s = model.all_gather_s(sp, gather_bytes, sp_spans)
    n_coll = (2 if tp > 1 else 0) + (1 if sp > 1 else 0)
    return CommEstimate(a2a_bytes, gather_bytes, a2a_s, gather_s, n_coll)


def _comm_uneven(heads: int, cores: int, shape: AttentionShape, model: CommModel) -> CommEstimate:
    """Ulysses with heads split unevenly (``ceil`` / ``floor``) over all cores; busiest rank's bytes."""
    e = shape.dtype_bytes * shape.batch
    chunk = math.ceil(shape.num_queries / cores)
    hi = math.ceil(heads / cores)
    lo_rank_heads = heads // cores
    # a rank with the fewest own heads sends the most; a rank with the most heads receives the most.
    sent = chunk * (heads - lo_rank_heads) * shape.head_dim * e
    received = (cores - 1) * chunk * hi * shape.head_dim * e
    one = max(sent, received)
    spans = _spans_chips(range(cores), model.cores_per_chip)
    a2a_s = model.all_to_all_s(cores, 3 * one, spans) + model.all_to_all_s(cores, one, spans)
    return CommEstimate(4 * one, 0, a2a_s, 0.0, 2 if cores > 1 else 0)


def _validate_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def plan(
    num_heads: int,
    num_cores: int,
    *,
    shape: AttentionShape | None = None,
    model: CommModel | None = None,
    tp: int | None = None,
) -> ShardingPlan:
    """Choose the balanced TP x SP plan with the least modelled communication per layer.

    A plan is *balanced* when ``tp * sp == num_cores``, ``tp`` divides ``num_heads`` (no padding, every
    core gets ``num_heads / tp`` heads) and both ``tp`` and ``sp`` are legal Neuron collective group
    sizes (1, 2, 4, 8, 16 or a multiple of 32), and every SP rank gets at least one query. Among
    balanced plans the least modelled communication time wins (ties: fewer bytes, then larger ``tp``).
    Every other layout - each ``tp`` that divides heads or cores, heads zero-padded to the cores,
    heads split unevenly over the cores, Ulysses - is recorded in ``alternatives`` with the reason it
    was rejected.

    ``tp`` forces a particular balanced factorisation (e.g. to test a layout); it raises ``ValueError``
    with the rejection reason if that ``tp`` is not balanced and legal.

    Raises ``ValueError`` (naming the rule) if ``num_heads`` or ``num_cores`` < 1, or if no balanced
    plan exists (the message lists why each candidate failed); ``TypeError`` for non-int arguments.
    """
    num_heads = _validate_int("num_heads", num_heads, 1)
    num_cores = _validate_int("num_cores", num_cores, 1)
    shape = AttentionShape() if shape is None else shape
    model = CommModel() if model is None else model

    candidates: list[tuple[int, int, CommEstimate]] = []
    rejected: list[tuple[int, int, str, CommEstimate | None]] = []
    forced = None if tp is None else _validate_int("tp", tp, 1)
    tps = set(_divisors(num_heads)) | set(_divisors(num_cores))
    if forced is not None:
        tps.add(forced)
    for tp in sorted(tps):
        if num_cores % tp:
            rejected.append((tp, 0, f"tp={tp} does not divide {num_cores} cores", None))
            continue
        sp = num_cores // tp
        if num_heads % tp:
            rejected.append(
                (
                    tp,
                    sp,
                    f"tp={tp} does not divide {num_heads} heads (needs padding or an uneven split)",
                    None,
                )
            )
            continue
        if not is_legal_group_size(tp):
            rejected.append((tp, sp, f"illegal collective group size tp={tp} (legal: 1,2,4,8,16,32k)", None))
            continue
        if not is_legal_group_size(sp):
            rejected.append((tp, sp, f"illegal collective group size sp={sp} (legal: 1,2,4,8,16,32k)", None))
            continue
        if sp > shape.num_queries:
            rejected.append((tp, sp, f"sp={sp} exceeds {shape.num_queries} queries (empty shards)", None))
            continue
        candidates.append((tp, sp, _comm_tpxsp(tp, sp, num_heads, shape, model)))

    if not candidates:
        reasons = "; ".join(f"TP{tp}xSP{sp}: {why}" for tp, sp, why, _ in rejected)
        raise ValueError(
            f"no balanced plan covers {num_heads} heads on {num_cores} cores: {reasons}. "
            "Use a core count whose factorisation into tp (dividing the heads) x sp uses legal "
            "collective group sizes (1, 2, 4, 8, 16 or a multiple of 32)."
        )

    if forced is not None:
        match = [c for c in candidates if c[0] == forced]
        if not match:
            why = next(w for t, _, w, _ in rejected if t == forced)
            raise ValueError(
                f"tp={forced} is not a balanced plan for {num_heads} heads on {num_cores} cores: {why}"
            )
        best_tp, best_sp, best_comm = match[0]
    else:
        best_tp, best_sp, best_comm = min(candidates, key=lambda c: (c[2].total_s, c[2].total_bytes, -c[0]))

    alternatives: list[Alternative] = []
    for tp, sp, comm in candidates:
        chosen = tp == best_tp
        cmp = f"modelled communication {comm.total_s * 1e6:.0f} us vs {best_comm.total_s * 1e6:.0f} us"
        if chosen:
            why = ""
        elif forced is not None:
            why = f"not requested (tp={forced} forced); {cmp}"
        else:
            why = f"more {cmp}"
        hpc = num_heads // tp
        att = _attention_s(hpc, math.ceil(shape.num_queries / sp), shape, model)
        balance = num_heads * shape.num_queries / (num_cores * hpc * math.ceil(shape.num_queries / sp))
        alternatives.append(
            Alternative(_name(tp, sp, num_cores), "tpxsp", tp, sp, hpc, balance, att, comm, chosen, why)
        )
    for tp, sp, why in ((tp, sp, why) for tp, sp, why, _ in rejected):
        hpc = math.ceil(num_heads / tp)
        alternatives.append(
            Alternative(_name(tp, sp, num_cores), "tpxsp", tp, sp, hpc, None, None, None, False, why)
        )

    if num_cores > 1 and num_heads % num_cores:
        padded = math.ceil(num_heads / num_cores) * num_cores
        waste = (padded - num_heads) / padded
        legal = is_legal_group_size(num_cores)
        why = f"pads {num_heads}->{padded} heads: {waste:.0%} of attention compute wasted"
        if not legal:
            why += f"; illegal collective group size {num_cores}"
        alternatives.append(
            Alternative(
                f"padded TP{num_cores}",
                "padded-tp",
                num_cores,
                1,
                padded // num_cores,
                num_heads / padded,
                _attention_s(padded // num_cores, shape.num_queries, shape, model),
                _comm_tpxsp(num_cores, 1, padded, shape, model) if legal else None,
                False,
                why,
            )
        )
        hi, lo = math.ceil(num_heads / num_cores), num_heads // num_cores
        n_hi = num_heads - lo * num_cores
        balance = num_heads / (num_cores * hi)
        why = (
            f"uneven split [{hi}]x{n_hi}+[{lo}]x{num_cores - n_hi}: slowest core does {hi} heads, "
            f"{balance:.0%} balanced"
        )
        if lo == 0:
            why += f"; {num_cores - n_hi} cores idle"
        if not legal:
            why += f"; illegal collective group size {num_cores}"
        alternatives.append(
            Alternative(
                f"uneven TP{num_cores}",
                "uneven-tp",
                num_cores,
                1,
                hi,
                balance,
                _attention_s(hi, shape.num_queries, shape, model),
                _comm_uneven(num_heads, num_cores, shape, model) if legal else None,
                False,
                why,
            )
        )

    return ShardingPlan(
        num_heads=num_heads,
        num_cores=num_cores,
        tp=best_tp,
        sp=best_sp,
        heads_per_core=num_heads // best_tp,
        shape=shape,
        model=model,
        comm=best_comm,
        alternatives=tuple(alternatives),
    )


def _fmt_mb(b: int | None) -> str:
    return "-" if b is None else f"{b / 1e6:.2f}"


def plan_table(
    num_heads: int,
    num_cores: int,
    *,
    shape: AttentionShape | None = None,
    model: CommModel | None = None,
) -> str:
    """The chosen plan and every alternative as an aligned text table (communication is *modelled*)."""
    p = plan(num_heads, num_cores, shape=shape, model=model)
    s, m = p.shape, p.model
    head = [
        f"{num_heads} heads on {num_cores} cores -> {p.name} ({p.heads_per_core} heads/core, "
        f"queries split {p.sp} ways)",
        f"shape: {s.num_queries} queries x {s.num_keys} keys, head_dim {s.head_dim}, "
        f"{s.dtype_bytes} B/elem, batch {s.batch}",
        f"comm model ({m.name}, MODELLED): on-chip {m.intra_chip_bw_Bps / 1e9:.1f} GB/s, "
        f"cross-chip {m.inter_chip_bw_Bps / 1e9:.1f} GB/s, latency {m.fixed_latency_s * 1e6:.0f} us + "
        f"{m.hop_latency_s * 1e6:.0f} us/hop, {m.cores_per_chip} cores/chip",
        "bytes: per layer, busiest rank (all-to-all sent, all-gather received); comm us: MODELLED per layer;",
        f"attn us@peak: MODELLED busiest-core attention matmuls per layer at "
        f"{m.core_peak_flops / 1e12:.0f} TFLOP/s (lower bound)",
        "",
    ]
    cols = [
        "",
        "plan",
        "tp",
        "sp",
        "heads/core",
        "balance",
        "a2a MB",
        "gather MB",
        "total MB",
        "comm us",
        "attn us@peak",
    ]
    rows: list[list[str]] = []
    order = sorted(p.alternatives, key=lambda a: (not a.chosen, a.comm is None, a.kind != "tpxsp", a.tp))
    for a in order:
        c = a.comm
        rows.append(
            [
                "*" if a.chosen else "",
                a.name,
                str(a.tp),
                str(a.sp) if a.sp else "-",
                str(a.heads_per_core),
                "-" if a.attention_balance is None else f"{a.attention_balance:.1%}",
                _fmt_mb(None if c is None else c.all_to_all_bytes),
                _fmt_mb(None if c is None else c.all_gather_bytes),
                _fmt_mb(None if c is None else c.total_bytes),
                "-" if c is None else f"{c.total_s * 1e6:.0f}",
                "-" if a.attention_s is None else f"{a.attention_s * 1e6:.0f}",
            ]
        )
    widths = [max(len(cols[i]), *(len(r[i]) for r in rows)) for i in range(len(cols))]

    def line(cells: Sequence[str]) -> str:
        out = [cells[0].ljust(widths[0]), cells[1].ljust(widths[1])]
        out += [cells[i].rjust(widths[i]) for i in range(2, len(cells))]
        return "  ".join(out)

    body = [line(cols), line(["-" * w for w in widths])] + [line(r) for r in rows]
    reasons = ["", "why:"] + [f"  {a.name}: {'chosen' if a.chosen else a.reason}" for a in order]
    return "\n".join(head + body + reasons)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m sharding.plan --heads 12 --cores 8``: print :func:`plan_table`."""
    parser = argparse.ArgumentParser(prog="python -m sharding.plan", description=plan_table.__doc__)
    parser.add_argument("--heads", type=int, required=True, help="attention heads (Wan2.1-1.3B: 12)")
    parser.add_argument("--cores", type=int, required=True, help="NeuronCores (ranks)")
    d = AttentionShape()
    parser.add_argument("--queries", type=int, default=d.num_queries, help="query tokens per layer")
    parser.add_argument("--keys", type=int, default=d.num_keys, help="key tokens per query")
    parser.add_argument("--head-dim", type=int, default=d.head_dim)
    parser.add_argument("--dtype-bytes", type=int, default=d.dtype_bytes, help="2 for bf16")
    parser.add_argument("--model", choices=["conservative", "optimistic"], default="conservative")
    args = parser.parse_args(argv)
    shape = AttentionShape(args.queries, args.keys, args.head_dim, args.dtype_bytes)
    model = CommModel.optimistic() if args.model == "optimistic" else CommModel.conservative()
    try:
        print(plan_table(args.heads, args.cores, shape=shape, model=model))
    except ValueError as exc:
        parser.exit(2, f"error: {exc}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
