"""On-chip memory as the hardware and compiler have it (NKI 0.6 documentation, see docs/emulator.md):

* last-use liveness: a tile's bytes are taken from its first to its last access, not for the Python
  object's lifetime; a kernel that fits only that way runs (and computes the numpy reference), one that
  still overflows raises naming the peak and the tiles live at it;
* ``address=`` placement: placed tiles occupy their byte range; overlapping placed tiles raise while
  both are live (and only then); malformed / out-of-range / misaligned PSUM addresses raise;
* ``nl.shared_identity_matrix`` is an SBUF tile ("Create an identity matrix in SBUF");
* ``nl.NKIObject`` subclasses get a dataclass-like ``__init__`` / ``__post_init__``;
* ``nisa.nc_version`` members are ordered (``get_nc_version() >= nc_version.gen3``).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from nki_kernels import emulator as emu
from nki_kernels.emulator import HwConfig, TensorSpec, run
from nki_kernels.emulator import isa as nisa
from nki_kernels.emulator import language as nl

pytestmark = pytest.mark.emulator

HW64 = HwConfig(sbuf_bytes_per_partition=64 * 1024)  # room for two [128, 8192] fp32 tiles (32 KiB each)


def _chain(x, reread_a):
    """x: HBM [128, 8192] fp32.  a -> b -> c, each 32 KiB/partition; Python keeps all three alive."""
    out = nl.ndarray((128, 8192), nl.float32, buffer=nl.shared_hbm)
    a = nl.ndarray((128, 8192), nl.float32, name="a")
    b = nl.ndarray((128, 8192), nl.float32, name="b")
    c = nl.ndarray((128, 8192), nl.float32, name="c")
    nisa.dma_copy(a, x)  # 1
    nisa.tensor_scalar(b, a, nl.multiply, 2.0)  # 2: last use of a (unless reread_a)
    nisa.tensor_scalar(c, b, nl.add, 1.0)  # 3: a, b, c would be live here under Python lifetimes
    if reread_a:
        nisa.tensor_tensor(c, c, a, nl.add)  # 4: a is still needed: a, b, c live at #3
    nisa.dma_copy(out, c)
    return out


def test_kernel_that_fits_only_under_last_use_liveness_runs_and_computes():
    x = np.random.default_rng(0).standard_normal((128, 8192)).astype(np.float32)
    out, _ = run(_chain, x, False, hw=HW64)
    np.testing.assert_array_equal(out, x * 2 + 1)  # exact in fp32: *2 is exact, +1 one rounding as numpy
    run(_chain, TensorSpec((128, 8192), "float32"), False, hw=HW64, trace_only=True)


def test_kernel_that_still_overflows_names_peak_and_live_tiles():
    with pytest.raises(
        emu.SbufCapacityError,
        match=r"\[sbuf-capacity\] program 0: live SBUF peaks at 98304 B/partition at instruction #3 .*65536 "
        r"B/partition budget.*3 tiles live there: a \[128, 8192\] float32 \(32768 B/partition\); b .*; c ",
    ):
        run(_chain, TensorSpec((128, 8192), "float32"), True, hw=HW64, trace_only=True)


def test_never_accessed_tiles_take_nothing_but_one_oversized_tile_raises_at_allocation():
    def unused():
        keep = [nl.ndarray((128, 8192), nl.float32) for _ in range(10)]  # 320 KiB, never accessed
        return None if keep else None

    run(unused, hw=HW64)

    def too_big():
        nl.ndarray((128, 16385), nl.float32, name="big")

    with pytest.raises(emu.SbufCapacityError, match=r"big \[128, 16385\] float32 needs 65540 B/partition"):
        run(too_big, hw=HW64)


def test_lnc2_programs_are_checked_separately_and_the_error_names_the_program():
    def k(x):
        pid = nl.program_id(0)
        a = nl.ndarray((128, 8192), nl.float32, name="a")
        b = nl.ndarray((128, 8192), nl.float32, name="b")
        nisa.dma_copy(a, x)
        nisa.tensor_copy(b, a)
        if pid == 1:  # program 1 needs a third tile while a and b are live
            c = nl.ndarray((128, 8192), nl.float32, name="c")
            nisa.tensor_tensor(c, a, b, nl.add)
            nisa.tensor_copy(a, c)

    spec = TensorSpec((128, 8192), "float32")
    with pytest.raises(emu.SbufCapacityError, match=r"program 1: live SBUF peaks at 98304"):
        run(k, spec, lnc=2, hw=HW64, trace_only=True)


# ------------------------------------------------------------------------------------------ address=


def _placed(b_addr, overlap_live):
    a = nl.ndarray((64, 1024), nl.float32, name="a", address=(0, 0))  # partitions [0, 64), bytes [0, 4096)
    nisa.memset(a, 1.0)
    b = nl.ndarray((32, 512), nl.float32, name="b", address=b_addr)
    nisa.memset(b, 2.0)
    if overlap_live:
        nisa.tensor_copy(b, a[0:32, 0:512])  # a is read after b was written: both live


def test_overlapping_placed_tiles_raise_while_both_live():
    with pytest.raises(
        emu.AllocationError,
        match=r"\[address-overlap\] program 0: SBUF tiles a \[64, 1024\] float32 \(4096 B/partition\) at "
        r"address=\(0, 0\) and b \[32, 512\].*at address=\(16, 2048\) overlap \(partitions \[16, 48\), "
        r"bytes \[2048, 4096\)\) while both are live \(instructions #1..#3 and #2..#3\)",
    ):
        run(_placed, (16, 2048), True, trace_only=True)


def test_placed_tiles_may_share_bytes_when_not_live_together_or_disjoint():
    run(_placed, (16, 2048), False, trace_only=True)  # a's last use (#1) precedes b's first (#2)
    run(_placed, (64, 0), True, trace_only=True)  # partitions [64, 96): disjoint from a's [0, 64)
    run(_placed, (0, 4096), True, trace_only=True)  # bytes [4096, 6144): disjoint from a's [0, 4096)


def test_placed_tiles_count_towards_capacity():
    def k():
        a = nl.ndarray((128, 8192), nl.float32, name="a", address=(0, 0))
        b = nl.ndarray((128, 8192), nl.float32, name="b")
        c = nl.ndarray((1, 1), nl.float32, name="c")
        nisa.memset(a, 0.0)
        nisa.memset(b, 0.0)
        nisa.memset(c, 0.0)
        nisa.tensor_tensor(c, a[0:1, 0:1], b[0:1, 0:1], nl.add)

    with pytest.raises(
        emu.SbufCapacityError, match=r"peaks at 65540 B/partition.*a \[128, 8192\].*address=\(0, 0\)"
    ):
        run(k, hw=HW64, trace_only=True)


@pytest.mark.parametrize(
    ("shape", "buffer", "address", "err", "msg"),
    [
        (
            (128, 4),
            "sbuf",
            (1, 0),
            emu.AllocationError,
            r"partitions \[1, 129\) pass the 128-partition limit",
        ),
        ((8, 4), "sbuf", (0, 212_716), emu.AllocationError, r"bytes \[212716, 212732\).*212728 B/partition"),
        ((8, 4), "sbuf", (0,), emu.AllocationError, r"must be \(partition_offset, byte_offset\)"),
        ((8, 4), "sbuf", (-1, 0), emu.AllocationError, r"non-negative ints"),
        ((128, 512), "psum", (0, 1024), emu.AllocationError, r"2048 B bank boundary, got byte offset 1024"),
        ((128, 512), "psum", (0, 14336 + 2048), emu.AllocationError, r"16384 B/partition of PSUM"),
        ((8, 4), "hbm", (0, 0), emu.MemorySpaceError, r"\[address\].*places SBUF/PSUM tensors only"),
    ],
)
def test_bad_addresses_raise_at_allocation(shape, buffer, address, err, msg):
    buf = {"sbuf": nl.sbuf, "psum": nl.psum, "hbm": nl.hbm}[buffer]

    def k():
        nl.ndarray(shape, nl.float32, buffer=buf, address=address)

    with pytest.raises(err, match=msg):
        run(k, trace_only=True)


def test_psum_address_on_a_bank_boundary_is_accepted():
    def k():
        t = nl.ndarray((128, 512), nl.float32, buffer=nl.psum, address=(0, 7 * 2048))
        nisa.memset(t, 0.0)

    run(k, trace_only=True)


# ------------------------------------------------------------------------------- shared_identity_matrix


def test_shared_identity_matrix_is_an_sbuf_identity_usable_by_the_tensor_engine():
    x = np.random.default_rng(1).standard_normal((96, 64)).astype(np.float32)

    def k2(x):
        ident = nl.shared_identity_matrix(96, dtype=nl.float32)
        assert ident.buffer is nl.sbuf and ident.shape == (96, 96)
        xs = nl.load(x)
        ps = nl.ndarray((64, 96), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(ps, xs, ident, is_transpose=True)  # the identity must be an SBUF operand
        sb = nl.ndarray((64, 96), nl.float32)
        nisa.tensor_copy(sb, ps)
        out = nl.ndarray((96, 96), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(out, ident)
        outT = nl.ndarray((64, 96), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(outT, sb)
        return out, outT

    (ident, xt), tr = run(k2, x)
    np.testing.assert_array_equal(ident, np.eye(96, dtype=np.float32))
    np.testing.assert_array_equal(xt, x.T)  # transpose mode is a bit-exact pass-through
    # the constant reaches SBUF with one DMA from HBM
    assert [r.direction for r, _ in tr.select(op="dma_copy")][0] == "hbm->sbuf"


def test_shared_identity_matrix_default_dtype_dst_and_limits():
    def k():
        ident = nl.shared_identity_matrix(4)
        dst = nl.ndarray((8, 8), nl.bfloat16)
        got = nl.shared_identity_matrix(8, dst=dst)
        assert got is dst
        o1 = nl.ndarray((4, 4), nl.uint8, buffer=nl.shared_hbm)
        nisa.dma_copy(o1, ident)
        o2 = nl.ndarray((8, 8), nl.bfloat16, buffer=nl.shared_hbm)
        nisa.dma_copy(o2, dst)
        return o1, o2

    (o1, o2), _ = run(k)
    assert o1.dtype == np.uint8
    np.testing.assert_array_equal(o1, np.eye(4, dtype=np.uint8))
    np.testing.assert_array_equal(o2.astype(np.float32), np.eye(8, dtype=np.float32))

    def too_many_partitions():
        nl.shared_identity_matrix(129)

    with pytest.raises(emu.PartitionLimitError, match=r"\[129, 129\]"):
        run(too_many_partitions, trace_only=True)

    def psum_dst():
        nl.shared_identity_matrix(8, dst=nl.ndarray((8, 8), nl.float32, buffer=nl.psum))

    with pytest.raises(emu.MemorySpaceError, match="dst must be an SBUF tensor"):
        run(psum_dst, trace_only=True)


# ------------------------------------------------------------------------------------------ NKIObject


class _Tile(nl.NKIObject):
    rows: int
    cols: int = 512
    scale: float = 1.0

    def __post_init__(self):
        self.size = self.rows * self.cols


class _Tile3(_Tile):
    depth: int = 2
    tags: list = dataclasses.field(default_factory=list)


def test_nkiobject_subclasses_get_a_dataclass_like_init():
    t = _Tile(128)
    assert (t.rows, t.cols, t.scale, t.size) == (128, 512, 1.0, 128 * 512)
    t = _Tile(64, scale=0.5, cols=8)
    assert (t.rows, t.cols, t.scale, t.size) == (64, 8, 0.5, 512)
    u, v = _Tile3(1, 2, 3.0, 4), _Tile3(1)
    assert (u.rows, u.cols, u.scale, u.depth, u.tags, u.size) == (1, 2, 3.0, 4, [], 2)
    assert v.tags == [] and v.tags is not u.tags  # default_factory: a fresh list each
    assert repr(_Tile(2, 3)) == "_Tile(rows=2, cols=3, scale=1.0)"
    # a field without a default defaults to None (NKI 0.6): tests/test_emulator_nkiobject.py
    with pytest.raises(TypeError, match="unexpected keyword arguments \\['colz'\\]"):
        _Tile(1, colz=2)
    with pytest.raises(TypeError, match="takes 3 positional arguments"):
        _Tile(1, 2, 3.0, 4)
    with pytest.raises(TypeError, match="multiple values for field 'rows'"):
        _Tile(1, rows=2)


def test_nkiobject_keeps_an_explicit_init_or_dataclass():
    class Own(nl.NKIObject):
        x: int

        def __init__(self, v):
            self.x = v * 10

    @dataclasses.dataclass(frozen=True)
    class Frozen(nl.NKIObject):
        a: int
        b: int = 3

    assert Own(2).x == 20
    f = Frozen(1)
    assert (f.a, f.b) == (1, 3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        f.a = 2


# ----------------------------------------------------------------------------------------- nc_version


def test_nc_version_members_are_ordered():
    v = nisa.nc_version
    assert v.gen2 < v.gen3 < v.gen4 and v.gen4 >= v.gen3 >= v.gen3 and v.gen2 <= v.gen2
    assert not v.gen3 > v.gen4
    assert sorted([v.gen4, v.gen2, v.gen3]) == [v.gen2, v.gen3, v.gen4]
    assert v.gen3 == v.gen3 and v.gen3 != 3
    with pytest.raises(TypeError):
        _ = v.gen3 >= 3

    seen = {}

    def k():
        seen["v"] = nisa.get_nc_version()
        seen["ge3"] = nisa.get_nc_version() >= nisa.nc_version.gen3

    run(k)
    assert seen == {"v": v.gen3, "ge3": True}  # trn2 default
    run(k, hw=HwConfig(nc_version=2))
    assert seen == {"v": v.gen2, "ge3": False}
