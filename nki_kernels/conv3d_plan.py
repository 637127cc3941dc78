"""Tile plan of the causal 3-D convolution kernel (:mod:`nki_kernels.conv3d`): how the contraction and the
output channels are packed onto the 128 x 128 PE array, the band and PSUM-bank sizes, the SBUF budget.

Pure Python (no NKI calls): the kernel evaluates it while it is traced, the op calls it to refuse a shape
early, tests and the performance model read it.

**Packing** (``s`` output rows per *row group*, ``at`` time taps in the contraction).  Output row
``r = s * j + u`` (``u < s``) of row group ``j`` reads input rows ``s * j + u + b - kh // 2``; with
``o = u + b = s * k + o_in`` (``o_in < s``) that is input row ``s * (j + k) + o_in - kh // 2``.  So:

* the **contraction rows** (SBUF partitions of the moving band) are ``(o_in, a_in, ci)``, ``o_in < s``,
  ``a_in < at``, flattened in that order into ``k_tiles`` tiles of 128 (the last one partial): partition
  ``(o_in, a_in, ci)`` of row ``j`` holds input row ``s * j + o_in - kh // 2`` of channel ``ci`` of frame
  ``f + a_in`` (a space-to-depth layout: every input row sits in exactly one place);
* the **PE columns** (stationary free dim = PSUM partitions) are ``(v, co)``, ``v < s``, flattened into
  ``m_tiles`` tiles of 128: column ``(v, co)`` accumulates output row ``s * j + u`` of channel ``co``,
  ``u = s - 1 - v`` (reversed, so that the taps ``b`` of consecutive column blocks are consecutive in
  ``w`` and one weight DMA covers them);
* what is left is looped: ``kt / at`` time offsets (which band of frames), ``ko = ceil((s + kh - 1) / s)``
  row-group offsets ``k`` (the moving access pattern starts ``k`` rows down) and the ``kw`` column taps
  (the moving pattern starts ``c - kw // 2`` columns over; the output columns a shift would read outside
  the image are left out of that matmul, so the band needs no padding columns);
* the stationary block for ``(a_out, c, k)``, contraction tile ``g`` and column tile ``m`` holds
  ``w[(a, b, c)][ci, co]`` at row ``(o_in, a_in, ci)``, column ``(v, co)``, with ``a = a_out * at + a_in``
  and ``b = s * k + o_in - u`` when ``0 <= b < kh``, else zero; blocks that are zero everywhere are not
  issued (:attr:`ConvPlan.blocks`).

``s = 1, at = 1`` is the plain blocked implicit GEMM (channels on partitions, every tap a matmul);
``s > 1`` fills the PE columns when ``C_out < 128`` and the rows when ``C_in`` leaves some idle;
``at = kt`` fills the rows when ``s * C_in`` alone does not fill a tile.  :func:`plan_conv` estimates every
candidate with the planner's own coarse figures (:func:`estimate_ns`: TensorE cycles per matmul, DMA bytes
and instruction counts) and keeps the cheapest that fits.

**SBUF** (bytes per partition): resident weights ``kt/at x kw x ko x k_tiles x s*C_out x itemsize`` <=
:data:`W_BYTES_MAX`; band slots ``n_slots x k_tiles x (j + ko - 1) x W x itemsize`` (``n_slots = 2`` with
the time taps packed, ``kt + 1`` frames rotating when they are looped); output staging ``3 x j x W x
itemsize``; all three <= :data:`SBUF_BYTES`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from nki_kernels.hw_limits import GEMM_MOVING_FMAX, PMAX, PSUM_BANK_FMAX

__all__ = [
    "KERNEL_SIZES",
    "S_MAX",
    "SBUF_BYTES",
    "W_BYTES_MAX",
    "ConvPlan",
    "candidate_plans",
    "estimate_ns",
    "forced_plan",
    "make_plan",
    "plan_conv",
]

W_BYTES_MAX = 96 * 1024
"""SBUF bytes per partition for the resident (packed) weights."""

SBUF_BYTES = 192 * 1024
"""SBUF bytes per partition the kernel uses in all: weights + band slots + output staging (of the 212,728
the emulator and the trn2 compiler allow)."""

S_MAX = 16
"""Most output rows per row group the planner tries."""

KERNEL_SIZES = (1, 3)
"""Kernel extents the kernel takes per axis (time, height, width)."""

# the planner's own coarse figures (trn2, bf16; not the cost model, which prices the trace)
_PE_HZ = 2.4e9  # TensorE clock
_MM_OVERHEAD = 10  # cycles per matmul instruction
_MM_SMALL = 160  # extra cycles when K, M or N < 128
_DMA_ISSUE_NS = 486.0  # per DMA instruction, issued one after another
_DMA_GBPS = ((128, 25.0), (256, 50.0), (512, 299.0), (2048, 244.0), (4096, 354.0))  # by contiguous run


@dataclass(frozen=True)
class ConvPlan:
    """One packing of the convolution (module docstring).  Sizes are Python ints.

    ``blocks[m]``: the ``(k, g)`` pairs (row-group offset, contraction tile) whose stationary block for
    column tile ``m`` is not all zero (the same for every time offset and column tap).
    """

    c_in: int
    c_out: int
    h: int
    w: int
    itemsize: int
    ksize: tuple[int, int, int]
    s: int
    at: int
    j: int
    jb: int
    seg: int
    blocks: tuple[tuple[tuple[int, int], ...], ...]

    @property
    def kp(self) -> int:
        """Contraction rows ``s x at x C_in``."""
        return self.s * self.at * self.c_in

    @property
    def k_tiles(self) -> int:
        return math.ceil(self.kp / PMAX)

    @property
    def mp(self) -> int:
        """PE columns ``s x C_out``."""
        return self.s * self.c_out

    @property
    def m_tiles(self) -> int:
        return math.ceil(self.mp / PMAX)

    @property
    def ko(self) -> int:
        """Row-group offsets ``ceil((s + kh - 1) / s)``."""
        return math.ceil((self.s + self.ksize[1] - 1) / self.s)

    @property
    def a_loops(self) -> int:
        """Time offsets looped (``kt / at``)."""
        return self.ksize[0] // self.at

    @property
    def groups(self) -> int:
        """Row groups of the image, ``ceil(H / s)``."""
        return math.ceil(self.h / self.s)

    @property
    def n_slots(self) -> int:
        """Band slots in SBUF: 2 with the time taps packed, else ``kt + 1`` frames rotating."""
        return 2 if self.at == self.ksize[0] else self.ksize[0] + 1

    @property
    def band_rows(self) -> int:
        """Row groups one band slot holds, ``j + ko - 1``."""
        return self.j + self.ko - 1

    def w_bytes(self) -> int:
        """Resident weight bytes per partition."""
        return self.a_loops * self.ksize[2] * self.ko * self.k_tiles * self.mp * self.itemsize

    def band_bytes(self) -> int:
        """Band slot bytes per partition (all slots)."""
        return self.n_slots * self.k_tiles * self.band_rows * self.w * self.itemsize

    def out_bytes(self) -> int:
        """Output staging bytes per partition."""
        return 3 * self.j * self.w * self.itemsize

    def w_index(self, a_out: int, c: int, k: int, g: int) -> int:
        """Free offset (elements) of the stationary block ``(a_out, c, k, g)`` in the weight tile: order
        ``(a_out, k, g, c, column)``, so the ``kw`` blocks of one ``(a_out, k, g)`` are contiguous."""
        return (((a_out * self.ko + k) * self.k_tiles + g) * self.ksize[2] + c) * self.mp

    def u_range(self, o_in: int, k: int) -> tuple[int, int]:
        """``[lo, hi]`` of the column blocks ``v`` (output row ``u = s - 1 - v``) whose tap
        ``b = s*k + o_in - u`` lies in ``[0, kh)`` for row phase ``o_in`` and row-group offset ``k``
        (``lo > hi``: none)."""
        s, kh = self.s, self.ksize[1]
        return max(0, s - 1 - s * k - o_in), min(s - 1, kh - 1 + s - 1 - s * k - o_in)

    def matmuls_per_bank(self) -> int:
        """Matmuls accumulated into one PSUM bank, summed over the column tiles."""
        return sum(len(b) for b in self.blocks) * self.a_loops * self.ksize[2]


def _row_span(g: int, width: int, kp: int) -> tuple[int, int]:
    """First and last ``o_in`` (rows of ``width`` channels each) in contraction tile ``g``."""
    r0, r1 = g * PMAX, min(kp, (g + 1) * PMAX) - 1
    return r0 // width, r1 // width


def _blocks(s: int, at: int, c_in: int, c_out: int, kh: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    kp, mp = s * at * c_in, s * c_out
    ko = math.ceil((s + kh - 1) / s)
    out = []
    for m in range(math.ceil(mp / PMAX)):
        v0, v1 = m * PMAX // c_out, (min(mp, (m + 1) * PMAX) - 1) // c_out
        u0, u1 = s - 1 - v1, s - 1 - v0  # column block v holds output row u = s - 1 - v
        row = []
        for k in range(ko):
            for g in range(math.ceil(kp / PMAX)):
                o0, o1 = _row_span(g, at * c_in, kp)
                if s * k + o0 - u1 <= kh - 1 and s * k + o1 - u0 >= 0:  # some b = s*k + o_in - u in [0, kh)
                    row.append((k, g))
        out.append(tuple(row))
    return tuple(out)


def make_plan(
    c_in: int, c_out: int, h: int, w: int, itemsize: int, ksize: tuple[int, int, int], s: int, at: int
) -> ConvPlan | None:
    """The plan for ``(s, at)`` with the most row groups per band that fit, or ``None`` when none fits."""
    kt, kh, _ = ksize
    if at not in (1, kt) or s < 1:
        raise ValueError(f"make_plan: at must be 1 or kt={kt} and s >= 1, got at={at}, s={s}")
    seg = math.ceil(w / math.ceil(w / GEMM_MOVING_FMAX))
    groups = math.ceil(h / s)
    blocks = _blocks(s, at, c_in, c_out, kh)
    jb = max(1, min(groups, PSUM_BANK_FMAX // seg))
    j = groups
    while j >= 1:
        p = ConvPlan(c_in, c_out, h, w, itemsize, ksize, s, at, j, min(j, jb), seg, blocks)
        if p.w_bytes() <= W_BYTES_MAX and p.w_bytes() + p.band_bytes() + p.out_bytes() <= SBUF_BYTES:
            break
        j -= 1
    if j < 1:
        return None
    j = math.ceil(groups / math.ceil(groups / j))  # equal bands
    return ConvPlan(c_in, c_out, h, w, itemsize, ksize, s, at, j, min(j, jb), seg, blocks)


def forced_plan(
    c_in: int,
    c_out: int,
    h: int,
    w: int,
    itemsize: int,
    ksize: tuple[int, int, int],
    packing: tuple[int, int],
) -> ConvPlan:
    """The plan for a given ``packing = (s, at)`` (``at`` 1 or ``kt``, ``1 <= s <= H``) instead of the
    planner's choice; ``ValueError`` naming ``packing`` when it is malformed or does not fit."""
    plan_conv(c_in, c_out, h, w, itemsize, ksize)  # the arguments' own checks
    if (
        not isinstance(packing, tuple)
        or len(packing) != 2
        or any(isinstance(v, bool) or not isinstance(v, int) for v in packing)
        or not 1 <= packing[0] <= h
        or packing[1] not in (1, ksize[0])
    ):
        raise ValueError(
            f"conv3d: packing must be (s, at) with 1 <= s <= H={h} and at in (1, kt={ksize[0]}), "
            f"got {packing!r}"
        )
    p = make_plan(c_in, c_out, h, w, itemsize, ksize, packing[0], packing[1])
    if p is None:
        raise ValueError(
            f"conv3d: packing {packing} does not fit SBUF for C_in={c_in}, C_out={c_out}, W={w} (weights "
            f"<= {W_BYTES_MAX} B, all <= {SBUF_BYTES} B per partition)"
        )
    return p


def _gbps(run_bytes: int) -> float:
    pts = _DMA_GBPS
    if run_bytes <= pts[0][0]:
        return pts[0][1] * run_bytes / pts[0][0]
    for (sa, va), (sb, vb) in zip(pts, pts[1:]):
        if run_bytes <= sb:
            t = (math.log2(run_bytes) - math.log2(sa)) / (math.log2(sb) - math.log2(sa))
            return va + t * (vb - va)
    return pts[-1][1]


def estimate_ns(p: ConvPlan, frames: int = 1) -> float:
    """The planner's coarse time of one call producing ``frames`` output frames (ns): ``max(TensorE, DMA
    data, DMA issue) +`` the weight load.  TensorE ``max(64, N) x f + 10`` cycles per matmul (+160 with K, M
    or N below 128; ``f`` 4 for fp32) at 2.4 GHz; DMA by contiguous run length (25-354 GB/s); 486 ns per DMA
    instruction.  For choosing a plan only: the cost model prices the traced kernel."""
    kt, kh, kw = p.ksize
    f = 4 if p.itemsize == 4 else 1
    cycles = 0.0
    for m, blk in enumerate(p.blocks):
        mm = min(PMAX, p.mp - m * PMAX)
        for j0 in range(0, p.groups, p.j):
            jn = min(p.j, p.groups - j0)
            for q0 in range(0, jn, p.jb):
                for s0 in range(0, p.w, p.seg):
                    n = min(p.jb, jn - q0) * min(p.seg, p.w - s0)
                    for _, g in blk:
                        small = _MM_SMALL if min(PMAX, p.kp - g * PMAX, mm, n) < PMAX else 0
                        cycles += (max(64, n) * f + _MM_OVERHEAD + small) * p.a_loops * kw
    pe_ns = cycles * frames / (_PE_HZ * 1e-9)
    bands = math.ceil(p.groups / p.j)
    slots = bands * (frames if p.at == kt else frames + kt - 1)  # slot loads per call
    slot_bytes = p.kp * p.band_rows * p.w * p.itemsize
    run = p.w * p.itemsize * (p.band_rows if p.s == 1 else 1)  # rows are contiguous when s = 1
    out_run = p.w * p.itemsize * (p.j if p.s == 1 else 1)
    out_bytes = frames * p.h * p.w * p.c_out * p.itemsize
    dma_ns = slots * slot_bytes / _gbps(run) + out_bytes / _gbps(out_run)
    n_dma = slots * (p.s * p.at + p.k_tiles) + frames * bands * (p.s + p.m_tiles)  # loads + stores
    w_load = p.s * kt * kh * kw * p.c_in * p.c_out * p.itemsize / _gbps(p.c_out * p.itemsize)
    return max(pe_ns, dma_ns, n_dma * _DMA_ISSUE_NS) + w_load


def candidate_plans(
    c_in: int, c_out: int, h: int, w: int, itemsize: int, ksize: tuple[int, int, int]
) -> list[ConvPlan]:
    """Every ``(s, at)`` plan that fits, ``s`` from 1 to ``min(S_MAX, H)``."""
    out = []
    for at in sorted({1, ksize[0]}):
        for s in range(1, min(S_MAX, h) + 1):
            p = make_plan(c_in, c_out, h, w, itemsize, ksize, s, at)
            if p is not None:
                out.append(p)
    return out


def plan_conv(
    c_in: int,
    c_out: int,
    h: int,
    w: int,
    itemsize: int,
    ksize: tuple[int, int, int] = (3, 3, 3),
    frames: int = 1,
) -> ConvPlan:
    """The cheapest fitting :class:`ConvPlan` by :func:`estimate_ns` at ``frames`` output frames (ties: the
    smaller ``s``, then time taps looped).  Raises ``ValueError`` naming the argument and the limit when
    the arguments are bad or no plan fits (the weights, or a one-row band, do not fit their SBUF share)."""
    for name, v in (
        ("c_in", c_in),
        ("c_out", c_out),
        ("h", h),
        ("w", w),
        ("itemsize", itemsize),
        ("frames", frames),
    ):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"plan_conv: {name} must be a positive int, got {v!r}")
    if len(ksize) != 3 or any(k not in KERNEL_SIZES for k in ksize):
        raise ValueError(
            f"conv3d: ksize must be 3 extents (time, height, width) each in {KERNEL_SIZES}, got {ksize}"
        )
    ks = (int(ksize[0]), int(ksize[1]), int(ksize[2]))
    cands = candidate_plans(c_in, c_out, h, w, itemsize, ks)
    if not cands:
        kt, kh, kw = ks
        wb = kw * kh * math.ceil(kt * c_in / PMAX) * c_out * itemsize
        if wb > W_BYTES_MAX:
            raise ValueError(
                f"conv3d: weights of C_in={c_in} x C_out={c_out} need {wb} B per partition resident, "
                f"more than {W_BYTES_MAX}; split C_out"
            )
        raise ValueError(
            f"conv3d: W={w} is too wide: a band of {kh} input rows of {w} elements (C_in={c_in}, kt={kt}) "
            f"and its output staging do not fit {SBUF_BYTES} B per partition next to the weights"
        )
    return min(cands, key=lambda p: (round(estimate_ns(p, frames)), p.s, p.at))
