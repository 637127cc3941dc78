"""Overlap-aware critical path of the sharded forward: which collectives hide behind which compute.

On trn2 a collective runs on the chip's collective-communication (CC) cores over pre-built DMA rings,
asynchronously to the compute engines, which only trigger it and later wait for its completion; the
compiler keeps separate queues for compute and for each CC stream (AWS Neuron SDK, "Compute-Communication
Overlap in Neuron", ``neuron-runtime/explore/compute-comm-overlap.rst`` in github.com/aws-neuron/
aws-neuron-sdk). So a collective costs the critical path only where compute waits for it.

The model (all *modelled*):

* two in-order queues per rank: ``compute`` (every kernel of the forward, one after another: the chunk
  model's components, which already price each kernel's own engine overlap) and ``comm`` (one CC stream:
  collectives in the order the code issues them). An op starts when its queue is free and every op it
  depends on has ended (:func:`schedule`).
* dependencies are the sharded stream's data flow (:func:`layer_program`, from
  :func:`sharding.attention.sharded_attention` and the merged forward's local step): the layer's
  projection and q/k norm -> TP all-to-all -> SP gather of the new k/v -> RoPE -> the KV write (which also
  needs the SP gather of the cache share) -> roped copies -> attention -> inverse all-to-all -> o_proj and
  the rest of the block -> the next layer. The cache-share gather needs only the cache (written in
  earlier chunks) and its buffer, free once the previous layer's attention has read it
  (``gather_buffers`` = 1, the footprint's one buffer).
* exposed communication = the forward's makespan minus its compute: the time compute waits.
* contention: the CC cores share the DMA engines and HBM with compute (same source), unmeasured. Range:
  :data:`CONTENTION` x the HBM time (``hbm_bytes`` at the per-core HBM bandwidth) of the part of each
  collective that runs under compute, added to compute (0 at the optimistic end: the compute is not
  HBM-bound; 1 at the pessimistic end: every byte the hidden collective moves displaces a compute byte).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from sharding.layer_comm import LayerCollective

__all__ = [
    "CONTENTION",
    "COMM_SCHEDULES",
    "ENGINES",
    "Op",
    "Slot",
    "Schedule",
    "schedule",
    "check_schedule",
    "stage",
    "layer_program",
    "split_names",
    "ForwardOverlap",
    "forward_overlap",
    "CommAlternative",
    "SUB_BLOCKS",
    "ESTIMATE",
]

ENGINES = ("compute", "comm")
CONTENTION = {"optimistic": 0.0, "pessimistic": 1.0}
"""Share of a hidden collective's HBM time charged to the compute it runs under, per end (module doc)."""

SUB_BLOCKS = 4
"""Token sub-blocks of the not-built pipelining estimate (:func:`layer_program` ``pieces``)."""
ESTIMATE = f"overlap_sub{SUB_BLOCKS}"
"""The estimate's :class:`CommAlternative` name (never a chunk's charge: not in :data:`COMM_SCHEDULES`)."""

COMM_SCHEDULES = ("overlap", "serial_split", "serial_plan")
"""How the chunk model charges the per-layer collectives: ``overlap`` (this module's critical path over the
code's collectives), ``serial_split`` (the same collectives back to back with compute) and
``serial_plan`` (the plan's three per-layer collectives, one fused K/V + cache gather priced at the
plan's key count, back to back: the model before this module)."""

PRE = ("gate_residual_ffn+adaln_norm1_mod", "adaln_norm1_mod", "qkv_proj", "rmsnorm_qk")
"""Per-layer components before the layer's first collective that needs them (token shard, all heads)."""
ATTN = ("rope3d", "kv_cache_write", "rope3d_copies")
"""Per-layer components between the K/V gathers and the attention (the local step), with ``attn_*``."""
ORDER = (
    *PRE,
    *ATTN,
    "attn_merged",
    "attn_update",
    "attn_denoise",
    "o_proj",
    "gate_residual_sa+norm3_affine",
    "gate_residual_sa",
    "norm3_affine",
    "cross_q_proj",
    "rmsnorm_cross_q",
    "cross_attn",
    "cross_o_proj",
    "residual_cross+adaln_norm2_mod",
    "residual_cross",
    "adaln_norm2_mod",
    "ffn_up",
    "gelu_tanh",
    "ffn_down",
    "gate_residual_ffn",
)
"""Execution order of a layer's compute (components not listed run after these, in the post stage)."""


def stage(name: str) -> str:
    """``"pre"`` (before the layer's TP all-to-all / fresh gather), ``"attn"`` (the local step: RoPE, KV
    write, copies, attention and its layout changes) or ``"post"`` (after the inverse all-to-all)."""
    if name in PRE:
        return "pre"
    if name in ATTN or (name.startswith("attn_")):
        return "attn"
    return "post"


@dataclass(frozen=True)
class Op:
    """One item of a forward: ``engine`` ``"compute"`` or ``"comm"``, ``time_s`` (>= 0), the names of
    the ops it needs (``deps``) and, for a collective, the HBM bytes it moves on this rank."""

    name: str
    engine: str
    time_s: float
    deps: tuple[str, ...] = ()
    hbm_bytes: int = 0

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"Op {self.name!r}: engine must be one of {ENGINES}, got {self.engine!r}")
        if self.time_s < 0 or self.hbm_bytes < 0:
            raise ValueError(f"Op {self.name!r}: time_s and hbm_bytes must be >= 0")


@dataclass(frozen=True)
class Slot:
    """When ``op`` runs: ``[start, end)`` seconds from the start of the program."""

    op: Op
    start: float
    end: float


def _overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


@dataclass(frozen=True)
class Schedule:
    """The slots of a program (:func:`schedule`), in the order they were placed."""

    slots: tuple[Slot, ...]

    def slot(self, name: str) -> Slot:
        for s in self.slots:
            if s.op.name == name:
                return s
        raise KeyError(f"no op named {name!r} in the schedule")

    def on(self, engine: str) -> tuple[Slot, ...]:
        return tuple(s for s in self.slots if s.op.engine == engine)

    @property
    def makespan_s(self) -> float:
        return max((s.end for s in self.slots), default=0.0)

    @property
    def compute_s(self) -> float:
        return sum(s.op.time_s for s in self.on("compute"))

    @property
    def comm_s(self) -> float:
        """Every collective's time back to back (what a serial schedule charges)."""
        return sum(s.op.time_s for s in self.on("comm"))

    @property
    def exposed_s(self) -> float:
        """Time the compute queue waits: makespan minus compute (the collectives' cost on the path)."""
        return self.makespan_s - self.compute_s

    def hidden_s(self, name: str) -> float:
        """Seconds of collective ``name`` that run while compute runs."""
        c = self.slot(name)
        return sum(_overlap(c.start, c.end, s.start, s.end) for s in self.on("compute"))

    def under(self, name: str) -> tuple[str, ...]:
        """The compute ops collective ``name`` runs under (positive overlap), in order."""
        c = self.slot(name)
        return tuple(s.op.name for s in self.on("compute") if _overlap(c.start, c.end, s.start, s.end) > 0)

    def contention_s(self, factor: float, hbm_Bps: float) -> float:
        """``factor`` x the HBM time of the hidden part of every collective (module docstring)."""
        if factor < 0 or hbm_Bps <= 0:
            raise ValueError(f"contention_s: factor must be >= 0 and hbm_Bps > 0, got {factor}, {hbm_Bps}")
        total = 0.0
        for c in self.on("comm"):
            if c.op.time_s > 0:
                total += self.hidden_s(c.op.name) / c.op.time_s * c.op.hbm_bytes / hbm_Bps
        return factor * total


def schedule(ops: Sequence[Op]) -> Schedule:
    """Place ``ops`` on two in-order queues: each engine runs its ops in the order given; an op starts at
    ``max(its engine free, the end of every op in deps)``. Raises ``ValueError`` for a duplicate name, a
    dependency on an unknown op, or an order no schedule can follow (a queue's next op waits for an op
    that can only run after it)."""
    names = [o.name for o in ops]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"schedule: duplicate op names {dup[:5]}")
    known = set(names)
    for o in ops:
        missing = [d for d in o.deps if d not in known]
        if missing:
            raise ValueError(f"schedule: op {o.name!r} depends on unknown ops {missing}")
    queues = {e: [o for o in ops if o.engine == e] for e in ENGINES}
    head = dict.fromkeys(ENGINES, 0)
    free = dict.fromkeys(ENGINES, 0.0)
    end: dict[str, float] = {}
    slots: list[Slot] = []
    while any(head[e] < len(queues[e]) for e in ENGINES):
        placed = False
        for e in ENGINES:
            while head[e] < len(queues[e]):
                o = queues[e][head[e]]
                if any(d not in end for d in o.deps):
                    break
                start = max([free[e], *(end[d] for d in o.deps)])
                end[o.name] = free[e] = start + o.time_s
                slots.append(Slot(o, start, start + o.time_s))
                head[e] += 1
                placed = True
        if not placed:
            stuck = {e: queues[e][head[e]].name for e in ENGINES if head[e] < len(queues[e])}
            raise ValueError(f"schedule: no queue can advance (deadlock), next ops {stuck}")
    return Schedule(tuple(slots))


def check_schedule(sched: Schedule) -> None:
    """Raise ``AssertionError`` unless every op starts after each of its deps ended and no two ops of one
    engine overlap: the two rules :func:`schedule` must keep (used by tests as an independent check)."""
    end = {s.op.name: s.end for s in sched.slots}
    for s in sched.slots:
        for d in s.op.deps:
            assert s.start >= end[d] - 1e-15, f"{s.op.name} starts at {s.start} before its dep {d} ends"
    for e in ENGINES:
        on = sorted(sched.on(e), key=lambda s: s.start)
        for a, b in zip(on, on[1:]):
            assert b.start >= a.end - 1e-15, f"{a.op.name} and {b.op.name} overlap on {e}"


def _ordered(times: Mapping[str, float]) -> list[str]:
    known = [n for n in ORDER if n in times]
    return known + [n for n in times if n not in ORDER]


def split_names(times: Mapping[str, float]) -> tuple[str, ...]:
    """The compute components :func:`layer_program` splits into ``pieces`` token sub-blocks: the QKV
    projection and q/k norm, the layer's last attention-stage op (the attention, split by queries) and
    the first post-attention op (o_proj)."""
    names = _ordered(times)
    pre = [n for n in names if stage(n) == "pre"]
    attn = [n for n in names if stage(n) == "attn"]
    post = [n for n in names if stage(n) == "post"]
    head = pre[pre.index("qkv_proj") :] if "qkv_proj" in pre else pre[-1:]
    return (*head, *attn[-1:], *post[:1])


def layer_program(
    times: Mapping[str, float],
    collectives: Sequence[LayerCollective],
    layers: int,
    *,
    gather_buffers: int = 1,
    pieces: int = 1,
) -> list[Op]:
    """The ops of ``layers`` layers of one sharded forward (module docstring): ``times`` maps each
    per-layer compute component to its seconds per layer (ordered by :data:`ORDER`, unknown names in the
    post stage), ``collectives`` are :func:`sharding.layer_comm.layer_collectives` (issue order). Names
    are ``"<layer>:<component or role>"``. ``gather_buffers`` (>= 1): the cache share of layer ``l`` lands
    in the buffer layer ``l - gather_buffers`` read, so it waits for that layer's attention.

    ``pieces`` > 1 models token sub-blocks the stream does NOT have (an estimate): the ops of
    :func:`split_names` and the projection-bound collectives run as ``pieces`` equal parts named
    ``"<name>#<i>"`` (a collective part pays its whole ``latency_s`` + its share of the rest): part ``i``
    of the all-to-all and the new keys' gather needs part ``i`` of the projection + norm, the attention
    (all parts) needs every part of the new keys, part ``i`` of the output all-to-all needs part ``i`` of
    the attention (by queries) and part ``i`` of o_proj needs it.

    A collective of role ``"text_kv"`` (the compact KV layout's text k/v all-gather,
    :func:`perf.e2e.compact.text_kv_collective`) is issued after the layer's new-key collectives (the CC
    stream is idle under the attention), needs only its one-layer buffer (free once the previous layer's
    ``cross_attn`` ended) and the layer's ``cross_attn`` waits for it."""
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        raise ValueError(f"layer_program: layers must be an int >= 1, got {layers!r}")
    if isinstance(gather_buffers, bool) or not isinstance(gather_buffers, int) or gather_buffers < 1:
        raise ValueError(f"layer_program: gather_buffers must be an int >= 1, got {gather_buffers!r}")
    if isinstance(pieces, bool) or not isinstance(pieces, int) or pieces < 1:
        raise ValueError(f"layer_program: pieces must be an int >= 1, got {pieces!r}")
    names = _ordered(times)
    pre = [n for n in names if stage(n) == "pre"]
    attn = [n for n in names if stage(n) == "attn"]
    post = [n for n in names if stage(n) == "post"]
    if not attn or not pre:
        raise ValueError(f"layer_program: times need pre-attention and attention components, got {names}")
    if any(c.role == "text_kv" for c in collectives) and "cross_attn" not in post:
        raise ValueError(f"layer_program: a 'text_kv' collective needs a 'cross_attn' component, got {names}")
    split = set(split_names(times)) if pieces > 1 else set()
    k = pieces

    def parts(n: str) -> list[str]:
        return [f"{n}#{i}" for i in range(k)] if n in split else [n]

    roles = {c.role: c for c in collectives}
    readers = [n for n in attn if n == "kv_cache_write"] or [n for n in attn if n.startswith("attn_")]
    ops: list[Op] = []
    comm: list[Op] = []
    carry: tuple[str, ...] = ()  # what the next layer's first op needs besides the compute queue's order

    def coll(role: str, name: str, deps: Sequence[str], n: int = 1) -> str:
        c = roles[role]
        t = c.time_s if n == 1 else c.latency_s + (c.time_s - c.latency_s) / n
        comm.append(Op(name, "comm", t, tuple(deps), c.hbm_bytes // n))
        return name

    whole = [n for n in pre if n not in split]
    cut = [n for n in pre if n in split]
    for ly in range(layers):
        tag = f"{ly}:"
        if "kv_cache" in roles:  # issued first; needs only its buffer (module docstring)
            buf = ly - gather_buffers
            coll("kv_cache", tag + "kv_cache", (f"{buf}:{parts(attn[-1])[-1]}",) if buf >= 0 else ())
        first = True
        for n in whole:
            ops.append(Op(tag + n, "compute", times[n], carry if first else ()))
            first = False
        fresh: list[str] = []
        for i in range(k if cut else 1):
            for n in cut:
                ops.append(Op(tag + parts(n)[i], "compute", times[n] / k, carry if first else ()))
                first = False
            dep = [tag + (parts(cut[-1])[i] if cut else pre[-1])]
            sfx = f"#{i}" if cut and k > 1 else ""
            if "qkv_in" in roles:
                dep = [coll("qkv_in", f"{tag}qkv_in{sfx}", dep, k if sfx else 1)]
            if "kv_fresh" in roles:
                dep = [coll("kv_fresh", f"{tag}kv_fresh{sfx}", dep, k if sfx else 1)]
            fresh += dep
        if "text_kv" in roles:  # the compact layout's text k/v: cached, needs only its one-layer buffer
            coll("text_kv", tag + "text_kv", (f"{ly - 1}:cross_attn",) if ly else ())
        for i, n in enumerate(attn):
            for j, part in enumerate(parts(n)):
                deps: tuple[str, ...] = tuple(fresh) if i == 0 and j == 0 else ()
                if "kv_cache" in roles and n == readers[0] and j == 0:
                    deps = (*deps, tag + "kv_cache")
                ops.append(Op(tag + part, "compute", times[n] / len(parts(n)), deps))
        att = parts(attn[-1])
        outs = [(tag + a,) for a in att]
        if "out" in roles:
            names_out = [f"{tag}out#{i}" for i in range(len(att))] if len(att) > 1 else [f"{tag}out"]
            outs = [(coll("out", nm, o, len(att)),) for nm, o in zip(names_out, outs, strict=True)]
        for i, n in enumerate(post):
            ps = parts(n)
            for j, part in enumerate(ps):
                if i == 0:
                    deps = outs[j] if len(ps) > 1 else tuple(x for o in outs for x in o)
                else:
                    deps = ()
                if n == "cross_attn" and "text_kv" in roles:
                    deps = (*deps, tag + "text_kv")
                ops.append(Op(tag + part, "compute", times[n] / len(ps), deps))
        carry = () if post else tuple(x for o in outs for x in o)
    return ops + comm


@dataclass(frozen=True)
class ForwardOverlap:
    """One forward's layers on the two queues at one end: the schedule, its exposed communication and the
    contention charge (seconds per forward), and the per-layer collectives it was built from."""

    name: str
    layers: int
    sched: Schedule
    collectives: tuple[LayerCollective, ...]
    contention_s: float

    @property
    def exposed_s(self) -> float:
        return self.sched.exposed_s

    @property
    def charge_s(self) -> float:
        """What the forward's collectives cost the chunk: exposed time + contention."""
        return self.exposed_s + self.contention_s

    @property
    def serial_s(self) -> float:
        """The same collectives back to back with compute."""
        return self.sched.comm_s


def forward_overlap(
    name: str,
    times: Mapping[str, float],
    collectives: Sequence[LayerCollective],
    layers: int,
    *,
    end: str,
    hbm_Bps: float,
    gather_buffers: int = 1,
    pieces: int = 1,
) -> ForwardOverlap:
    """Schedule ``layers`` layers (:func:`layer_program`) and charge the contention of ``end``."""
    if end not in CONTENTION:
        raise ValueError(f"forward_overlap: end must be one of {tuple(CONTENTION)}, got {end!r}")
    program = layer_program(times, collectives, layers, gather_buffers=gather_buffers, pieces=pieces)
    sched = schedule(program)
    return ForwardOverlap(
        name, layers, sched, tuple(collectives), sched.contention_s(CONTENTION[end], hbm_Bps)
    )


@dataclass(frozen=True)
class CommAlternative:
    """The chunk's per-layer collectives under one of :data:`COMM_SCHEDULES`: their charge per chunk
    (seconds, the ``sharding_comm`` + ``comm_contention`` components), their count per chunk and the
    bytes one rank moves per layer (sent by all-to-alls + received by all-gathers, summed over forwards)."""

    schedule: str
    comm_s: float
    collectives: int
    bytes_per_layer: int = 0
    extra_kernel_calls: int = 0
    """Kernel calls per chunk beyond the chunk model's (the sub-block estimate's split kernels)."""
