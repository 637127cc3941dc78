"""Every hardware/API rule the emulator enforces: a kernel that breaks it, and the message checked."""

from __future__ import annotations

import numpy as np
import pytest

from nki_kernels import emulator as emu
from nki_kernels.emulator import HwConfig, TensorSpec, run
from nki_kernels.emulator import isa as nisa
from nki_kernels.emulator import language as nl

pytestmark = pytest.mark.emulator


def _run(fn, *args, **kw):
    return run(fn, *args, **kw)


def test_partition_limit_on_allocation():
    def k():
        nl.ndarray((256, 4), nl.float32, buffer=nl.sbuf)

    with pytest.raises(emu.PartitionLimitError, match=r"\[partition-limit\].*\[256, 4\].*128"):
        _run(k)


def test_partition_limit_on_psum_and_load():
    def k(x):
        nl.load(x)  # [200, 8] HBM -> SBUF tile of 200 partitions

    with pytest.raises(emu.PartitionLimitError, match="200"):
        _run(k, np.zeros((200, 8), np.float32))


def test_psum_total_limit():
    def k():
        banks = [nl.ndarray((128, 512), nl.float32, buffer=nl.psum, name=f"bank{i}") for i in range(8)]
        extra = nl.ndarray((128, 1), nl.float32, buffer=nl.psum, name="extra")
        for t in [*banks, extra]:
            nisa.memset(t, 0.0)  # instruction #9 writes extra while all 8 banks are still to be read
        for t in banks:
            nisa.memset(t, 1.0)

    with pytest.raises(
        emu.PsumLimitError,
        match=r"\[psum-total\] program 0: live PSUM peaks at 16388 B/partition at instruction #9 .*16384.*"
        r"9 tiles live there: bank0 \[128, 512\].*extra \[128, 1\] float32 \(4 B/partition\)",
    ):
        _run(k)


def test_psum_freed_after_last_use():
    def k():
        keep = []
        for _ in range(20):  # 20 banks stay referenced, but each is dead after its memset
            t = nl.ndarray((128, 512), nl.float32, buffer=nl.psum)
            nisa.memset(t, 0.0)
            keep.append(t)
        return None

    _run(k)


def test_psum_single_tensor_too_big():
    def k():
        nl.ndarray((128, 4097), nl.float32, buffer=nl.psum)

    with pytest.raises(emu.PsumLimitError, match=r"\[psum-total\].*\[128, 4097\]"):
        _run(k)


def test_matmul_dst_must_fit_one_bank():
    def k():
        a = nl.zeros((128, 128), nl.bfloat16)
        b = nl.zeros((128, 512), nl.bfloat16)
        ps = nl.ndarray((128, 1024), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(ps[:, 0:512], a, b)  # bank 0: fine
        nisa.nc_matmul(ps[:, 256:768], a, b)  # crosses bank 0/1

    with pytest.raises(emu.PsumLimitError, match=r"\[psum-bank\].*\[1024, 3071\].*2048 B"):
        _run(k)


def test_sbuf_capacity():
    hw = HwConfig(sbuf_bytes_per_partition=64 * 1024)

    def k():
        a = nl.ndarray((128, 8192), nl.float32, name="a")  # 32 KiB / partition
        b = nl.ndarray((128, 8192), nl.float32, name="b")  # 64 KiB: exactly full
        c = nl.ndarray((1, 1), nl.float32, name="c")  # over while a and b are still to be read
        nisa.memset(a, 1.0)
        nisa.memset(b, 2.0)
        nisa.tensor_copy(c, a[0:1, 0:1])  # instruction #3: a, b and c live
        nisa.tensor_copy(c, b[0:1, 0:1])

    with pytest.raises(
        emu.SbufCapacityError,
        match=r"\[sbuf-capacity\] program 0: live SBUF peaks at 65540 B/partition at instruction #3 .*65536.*"
        r"3 tiles live there: a \[128, 8192\] float32 \(32768 B/partition\); b \[128, 8192\].*c \[1, 1\]",
    ):
        _run(k, hw=hw)


def test_sbuf_capacity_default_is_trn2_budget():
    def k():
        nl.ndarray((128, 212_729), nl.uint8)

    with pytest.raises(emu.SbufCapacityError, match="212728"):
        _run(k, trace_only=True)


def test_sbuf_freed_after_last_use_and_at_kernel_exit():
    hw = HwConfig(sbuf_bytes_per_partition=64 * 1024)

    def k():
        keep = []
        for _ in range(10):
            t = nl.ndarray((128, 8192), nl.float32)  # 32 KiB, dead after its memset (still referenced)
            nisa.memset(t, 0.0)
            keep.append(t)

    _run(k, hw=hw)
    _run(k, hw=hw)  # a second launch starts from zero


@pytest.mark.parametrize(
    ("k_", "m", "n", "rule"),
    [(128, 129, 64, "matmul-stationary"), (128, 64, 513, "matmul-moving")],
)
def test_matmul_free_limits(k_, m, n, rule):
    def kern():
        a = nl.ndarray((k_, m), nl.bfloat16)
        b = nl.ndarray((k_, n), nl.bfloat16)
        ps = nl.ndarray((min(m, 128), n), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(ps, a, b)

    with pytest.raises(emu.MatmulTileError, match=rf"\[{rule}\].*{m if 'stationary' in rule else n}"):
        _run(kern, trace_only=True)


def test_matmul_contraction_mismatch():
    def kern():
        a = nl.ndarray((128, 64), nl.bfloat16)
        b = nl.ndarray((64, 64), nl.bfloat16)
        ps = nl.ndarray((64, 64), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(ps, a, b)

    with pytest.raises(emu.MatmulTileError, match=r"\[matmul-contraction\].*\[128, 64\].*\[64, 64\]"):
        _run(kern, trace_only=True)


def test_matmul_memory_spaces():
    def op_in_psum():
        a = nl.ndarray((64, 64), nl.float32, buffer=nl.psum)
        b = nl.ndarray((64, 64), nl.float32)
        ps = nl.ndarray((64, 64), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(ps, a, b)

    def dst_in_sbuf():
        a = nl.ndarray((64, 64), nl.float32)
        d = nl.ndarray((64, 64), nl.float32)
        nisa.nc_matmul(d, a, a)

    with pytest.raises(emu.MemorySpaceError, match=r"operands must be in SBUF.*psum"):
        _run(op_in_psum, trace_only=True)
    with pytest.raises(emu.MemorySpaceError, match=r"dst=.*must be in PSUM"):
        _run(dst_in_sbuf, trace_only=True)


def test_matmul_dtype_pairing():
    def k():
        a = nl.ndarray((64, 64), nl.float32)
        b = nl.ndarray((64, 64), nl.bfloat16)
        ps = nl.ndarray((64, 64), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(ps, a, b)

    with pytest.raises(emu.DtypeError, match=r"\[matmul-dtype\].*float32.*bfloat16"):
        _run(k, trace_only=True)


def test_no_dma_from_psum():
    def k(x):
        ps = nl.ndarray((4, 4), nl.float32, buffer=nl.psum)
        nisa.dma_copy(x, ps)

    with pytest.raises(emu.MemorySpaceError, match=r"dma_copy: src=.*PSUM"):
        _run(k, np.zeros((4, 4), np.float32))


def test_no_engine_op_on_hbm():
    def k(x):
        d = nl.ndarray((4, 4), nl.float32)
        nisa.tensor_tensor(d, x, x, nl.add)

    with pytest.raises(
        emu.MemorySpaceError, match=r"tensor_tensor: operand data1=.*\[4, 4\] is in private_hbm"
    ):
        _run(k, np.zeros((4, 4), np.float32))
    with pytest.raises(emu.MemorySpaceError, match="address space 'psum|sbuf'|expected psum\\|sbuf"):
        _run(lambda x: nl.exp(x), np.zeros((4, 4), np.float32))


def test_gpsimd_cannot_touch_psum():
    def k():
        ps = nl.ndarray((4, 4), nl.float32, buffer=nl.psum)
        s = nl.ndarray((4, 4), nl.float32)
        nisa.tensor_copy(s, ps, engine=nisa.engine.gpsimd)

    def k2():
        ps = nl.ndarray((4, 4), nl.int32, buffer=nl.psum)
        nisa.iota(ps, [[1, 4]])

    with pytest.raises(emu.MemorySpaceError, match="GpSimd cannot access PSUM"):
        _run(k, trace_only=True)
    with pytest.raises(emu.MemorySpaceError, match="iota: dst=.*must be in SBUF"):
        _run(k2, trace_only=True)


def test_tensor_tensor_both_psum_and_partition_mismatch():
    def both():
        a = nl.ndarray((4, 4), nl.float32, buffer=nl.psum)
        d = nl.ndarray((4, 4), nl.float32)
        nisa.tensor_tensor(d, a, a, nl.add)

    def mism():
        a = nl.ndarray((128, 512), nl.float32)
        b = nl.ndarray((1, 512), nl.float32)
        nisa.tensor_tensor(a, a, b, nl.add)

    with pytest.raises(emu.MemorySpaceError, match="cannot both be in PSUM"):
        _run(both, trace_only=True)
    with pytest.raises(emu.ShapeMismatchError, match=r"\[partition-mismatch\].*\[128, 512\].*\[1, 512\]"):
        _run(mism, trace_only=True)


@pytest.mark.parametrize(
    "index",
    [
        (slice(0, 129), slice(None)),
        (slice(None), slice(60, 70)),
        (slice(None), 64),
        (slice(None), -65),
        (slice(None), slice(10, 5)),
    ],
)
def test_out_of_bounds_slices(index):
    def k():
        t = nl.ndarray((128, 64), nl.float32)
        return t[index]

    with pytest.raises(emu.OutOfBoundsError, match=r"\[out-of-bounds\]"):
        _run(k, trace_only=True)


def test_out_of_bounds_ds_and_ap():
    def k_ds():
        nl.ndarray((128, 64), nl.float32)[:, nl.ds(60, 8)]

    def k_ap(x):  # refused when accessed (building the view alone is legal: test_emulator_ap_bounds.py)
        nisa.dma_copy(nl.ndarray((4, 65), nl.float32, buffer=nl.sbuf), x.ap([[64, 4], [1, 65]], offset=0))

    with pytest.raises(emu.OutOfBoundsError, match=r"nl.ds\(60, 8\)"):
        _run(k_ds, trace_only=True)
    with pytest.raises(emu.OutOfBoundsError, match=r"ap pattern.*\[0, 256\]"):
        _run(k_ap, np.zeros((4, 64), np.float32))


def _scatter(buf, row, src, mode):
    idx = nl.ndarray((1, 1), nl.int32)
    nisa.dma_copy(idx, row)
    t = nl.load(src)
    dst = buf.ap([[buf.shape[1], 1], [1, buf.shape[1]]], offset=0, scalar_offset=idx, indirect_dim=0)
    nisa.dma_copy(dst, t, oob_mode=mode)


def test_runtime_oob_error_and_skip():
    buf = np.zeros((4, 8), np.float32)
    src = np.ones((1, 8), np.float32)
    with pytest.raises(emu.OutOfBoundsError, match=r"runtime index 4 .*oob_mode=error"):
        _run(_scatter, buf, np.array([[4]], np.int32), src, nisa.oob_mode.error)
    _run(_scatter, buf, np.array([[4]], np.int32), src, nisa.oob_mode.skip)
    assert not buf.any()  # skipped: untouched
    _run(_scatter, buf, np.array([[2]], np.int32), src, nisa.oob_mode.error)
    np.testing.assert_array_equal(buf[2], 1.0)
    assert buf[[0, 1, 3]].sum() == 0


def test_partition_stride_illegal():
    def k_slice():
        nl.ndarray((128, 4), nl.float32)[0:128:2, :]

    def k_ap():
        nl.ndarray((16, 32), nl.float32).ap([[64, 8], [1, 32]])

    with pytest.raises(emu.ViewError, match=r"\[partition-stride\]"):
        _run(k_slice, trace_only=True)
    with pytest.raises(emu.ViewError, match=r"\[ap-partition\].*32"):
        _run(k_ap, trace_only=True)


def test_view_rules():
    def perm():
        nl.ndarray((4, 8, 2), nl.float32).permute((1, 0, 2))

    def bcast():
        nl.ndarray((4, 8), nl.float32).broadcast(1, 4)

    def reshape():
        t = nl.ndarray((4, 8, 2), nl.float32, buffer=nl.sbuf)
        t.permute((0, 2, 1)).reshape((4, 16))

    with pytest.raises(emu.ViewError, match=r"\[permute\].*partition dim first"):
        _run(perm, trace_only=True)
    with pytest.raises(emu.ViewError, match=r"\[broadcast\].*size 8"):
        _run(bcast, trace_only=True)
    with pytest.raises(emu.ViewError, match=r"\[reshape\].*cannot express"):
        _run(reshape, trace_only=True)


def test_dma_size_and_hwdge_dtype():
    def size(x):
        t = nl.ndarray((4, 4), nl.float32)
        nisa.dma_copy(t, x)

    def hw(x):
        t = nl.ndarray((4, 4), nl.bfloat16)
        nisa.dma_copy(t, x, dge_mode=nisa.dge_mode.hwdge)

    with pytest.raises(emu.ShapeMismatchError, match=r"\[dma-size\].*\[4, 4\].*\[4, 5\]"):
        _run(size, TensorSpec((4, 5), "float32"), trace_only=True)
    with pytest.raises(emu.DtypeError, match=r"hwdge.*bfloat16.*float32"):
        _run(hw, TensorSpec((4, 4), "float32"), trace_only=True)


def test_nc_transpose_limits():
    def k():
        a = nl.ndarray((64, 64), nl.float32)
        d = nl.ndarray((64, 64), nl.float32)
        nisa.nc_transpose(d, a, engine=nisa.engine.vector)

    with pytest.raises(emu.MatmulTileError, match=r"\[transpose-size\].*32x32"):
        _run(k, trace_only=True)


def test_ops_outside_kernel_and_string_buffer():
    with pytest.raises(emu.LaunchError, match="inside a kernel launch"):
        nl.ndarray((4, 4), nl.float32)
    with pytest.raises(TypeError, match="string buffer names are rejected"):
        _run(lambda: nl.ndarray((4, 4), nl.float32, buffer="sbuf"), trace_only=True)


def test_op_must_be_nl_function():
    def k():
        t = nl.ndarray((4, 4), nl.float32)
        nisa.tensor_tensor(t, t, t, "add")

    with pytest.raises(TypeError, match="op: expected an nl function"):
        _run(k, trace_only=True)


# ------------------------------------------------------------------ dma_transpose (NKI 0.6 contract)


HW = nisa.dge_mode.hwdge


def _dt_case(src_shape, dst_shape, *, axes=None, dtype="bfloat16", dst_dtype=None, src_sbuf=False,
             dst_buf=None, **kw):  # fmt: skip
    def k():
        src = nl.ndarray(src_shape, dtype, buffer=nl.sbuf if src_sbuf else nl.shared_hbm)
        dst = nl.ndarray(dst_shape, dst_dtype or dtype, buffer=dst_buf or nl.sbuf)
        nisa.dma_transpose(dst, src, axes=axes, **kw)

    return k


@pytest.mark.parametrize(
    "case, err, pattern",
    [
        # permutations: only (1,0), (2,1,0), (3,1,2,0)
        (dict(src_shape=(16, 8), dst_shape=(16, 8), axes=(0, 1)), emu.DmaTransposeError,
         r"\[dma-transpose-axes\] axes \(0, 1\).*\[16, 8\]"),
        (dict(src_shape=(16, 2, 8), dst_shape=(2, 8, 16), axes=(1, 2, 0)), emu.DmaTransposeError,
         r"\[dma-transpose-axes\] axes \(1, 2, 0\)"),
        # dst shape must be exactly the permuted src (same element count is not enough)
        (dict(src_shape=(16, 8), dst_shape=(4, 32)), emu.DmaTransposeError,
         r"\[dma-transpose-shape\] dst shape \[4, 32\].*\[16, 8\].*\[8, 16\]"),
        # dtypes: equal; hardware DGE 2-byte only; unknown also has the 2-/4-byte DMA transpose; 1-byte: none
        (dict(src_shape=(16, 8), dst_shape=(8, 16), dtype="float32", dge_mode=HW), emu.DtypeError,
         r"\[dma-transpose-dtype\] a hardware-DGE .*2-byte dtype, got float32.*dge_mode=hwdge"),
        (dict(src_shape=(16, 8), dst_shape=(8, 16), dtype="float8_e4m3"), emu.DtypeError,
         r"\[dma-transpose-dtype\] dge_mode=unknown: no lowering .*hardware DGE: .*2-byte.*DMA transpose: "
         r"needs a 2- or 4-byte dtype"),
        (dict(src_shape=(16, 8), dst_shape=(8, 16), dst_dtype="float16"), emu.DtypeError,
         r"\[dma-transpose-dtype\].*bfloat16.*float16"),
        # dst in SBUF
        (dict(src_shape=(16, 8), dst_shape=(8, 16), dst_buf="hbm"), emu.MemorySpaceError,
         r"\[memory-space\] dma_transpose: dst=.*must be in SBUF"),
        # hwdge source shape (only where hwdge is forced), 2-D: src.shape[0] == 16
        (dict(src_shape=(128, 64), dst_shape=(64, 128), dge_mode=HW), emu.DmaTransposeError,
         r"\[dma-transpose-hwdge\] a 2-D .*src.shape\[0\] == 16, got src\[128, 64\]"),
        (dict(src_shape=(128, 128), dst_shape=(128, 128), src_sbuf=True, dge_mode=HW),
         emu.DmaTransposeError, r"\[dma-transpose-hwdge\].*src\[128, 128\]"),
        # hwdge source shape, 3-D/4-D: shape[0] in {1,2,4,8,16} and (shape[0]*shape[-2]) % 16 == 0
        (dict(src_shape=(128, 16, 128), dst_shape=(128, 16, 128), src_sbuf=True, dge_mode=HW),
         emu.DmaTransposeError,
         r"\[dma-transpose-hwdge\] a 3-D .*\{1, 2, 4, 8, 16\}.*src\[128, 16, 128\]"),
        (dict(src_shape=(8, 1, 64), dst_shape=(64, 1, 8), dge_mode=HW), emu.DmaTransposeError,
         r"\[dma-transpose-hwdge\] a 3-D .*% 16 == 0, got src\[8, 1, 64\]"),
        (dict(src_shape=(4, 2, 3, 32), dst_shape=(32, 2, 3, 4), axes=(3, 1, 2, 0), dge_mode=HW),
         emu.DmaTransposeError,
         r"\[dma-transpose-hwdge\] a 4-D .*src\[4, 2, 3, 32\]"),
        # src.shape[-1] <= 128: dst.shape[0] == src.shape[-1] for every allowed permutation, so an SBUF dst
        # for a wider src cannot even be allocated (the rule shows as the partition limit of dst)
        (dict(src_shape=(16, 2, 256), dst_shape=(256, 2, 16)), emu.PartitionLimitError,
         r"\[partition-limit\].*\[256, 2, 16\].*128"),
        # a direct transpose accepts only dge_mode unknown / hwdge
        (dict(src_shape=(16, 8), dst_shape=(8, 16), dge_mode=nisa.dge_mode.swdge), emu.DmaTransposeError,
         r"\[dma-transpose-dge\] a direct .*got swdge.*\[16, 8\]"),
        # oob_mode=skip only with indirect (runtime) indexing
        (dict(src_shape=(16, 8), dst_shape=(8, 16), oob_mode=nisa.oob_mode.skip), emu.DmaTransposeError,
         r"\[dma-transpose-oob\] oob_mode=skip .*static view"),
    ],
)  # fmt: skip
def test_dma_transpose_rules(case, err, pattern):
    if case.get("dst_buf") == "hbm":
        case = {**case, "dst_buf": nl.shared_hbm}
    with pytest.raises(err, match=pattern):
        _run(_dt_case(**case))


@pytest.mark.parametrize("trace_only", [False, True])
def test_dma_transpose_rules_in_trace_only_mode(trace_only):
    def k(x):
        dst = nl.ndarray((64, 128), x.dtype)
        nisa.dma_transpose(dst, x, dge_mode=nisa.dge_mode.hwdge)

    with pytest.raises(emu.DmaTransposeError, match=r"\[dma-transpose-hwdge\].*src\[128, 64\]"):
        if trace_only:
            run(k, TensorSpec((128, 64), "bfloat16"), trace_only=True)
        else:
            run(k, np.zeros((128, 64), np.float16))


def _gather_case(n_rows=16, idx_shape=(16, 1), idx_dtype="uint32", idx_buf="sbuf", **kw):
    def k():
        src = nl.ndarray((64, 32), "bfloat16", buffer=nl.shared_hbm)
        idx = nl.ndarray(idx_shape, idx_dtype, buffer=nl.sbuf if idx_buf == "sbuf" else nl.shared_hbm)
        dst = nl.ndarray((32, n_rows), "bfloat16", buffer=nl.sbuf)
        if idx_buf == "sbuf":
            nisa.memset(idx, 0)
        view = src.ap([[32, n_rows], [1, 32]], vector_offset=idx, indirect_dim=0)
        nisa.dma_transpose(dst, view, axes=(1, 0), **kw)

    return k


@pytest.mark.parametrize(
    "kw, pattern",
    [
        (dict(dge_mode=nisa.dge_mode.hwdge), r"\[dma-transpose-dge\] an indirect .*got hwdge"),
        (dict(n_rows=8, idx_shape=(8, 1)), r"\[dma-transpose-indirect\].*% 16 == 0.*\[8, 32\]"),
        (dict(idx_dtype="int32"), r"\[dma-transpose-indirect\] indices must be a 2-D uint32 SBUF"),
        (dict(n_rows=32, idx_shape=(32, 2)), r"\[dma-transpose-indirect\] indices.shape\[0\].*\[32, 2\]"),
    ],
)  # fmt: skip
def test_dma_transpose_indirect_rules(kw, pattern):
    with pytest.raises(emu.DmaTransposeError, match=pattern):
        _run(_gather_case(**kw))


def test_dma_transpose_indirect_needs_trn2():
    with pytest.raises(emu.DmaTransposeError, match=r"trn2\+"):
        _run(_gather_case(), hw=HwConfig(nc_version=2))


# ------------------------------------------------------------------ nc_matmul(is_transpose=True)


def _tmode(k_, m, n, *, dst_dtype="bfloat16", moving=None, accumulate=None):
    def k():
        a = nl.ndarray((k_, m), "bfloat16", buffer=nl.sbuf)
        nisa.memset(a, 1.0)
        b = nl.ndarray((k_, n), "bfloat16", buffer=nl.sbuf)
        if moving is None:  # identity: keep the ones where partition p == column i (all-partition writes)
            ones = nl.ndarray((k_, n), "bfloat16", buffer=nl.sbuf)
            nisa.memset(ones, 1.0)
            nisa.affine_select(b, [[-1, n]], 1, ones, 0.0)
        else:
            nisa.memset(b, moving)
        ps = nl.ndarray((m, n), dst_dtype, buffer=nl.psum)
        nisa.nc_matmul(ps, a, b, is_transpose=True, accumulate=accumulate)

    return k


@pytest.mark.parametrize("trace_only", [False, True])
def test_matmul_transpose_mode_needs_square_identity_shape(trace_only):
    """A 'transpose' cannot hide a real matmul: moving must be [K, K] (checked in trace-only mode too)."""
    with pytest.raises(emu.MatmulTileError, match=r"\[matmul-transpose\].*moving\[128, 512\].*\[128, 128\]"):
        _run(_tmode(128, 128, 512, dst_dtype="bfloat16"), trace_only=trace_only)


def test_matmul_transpose_mode_needs_identity_values():
    with pytest.raises(emu.MatmulTileError, match=r"\[matmul-transpose\].*must be the \[64, 64\] identity"):
        _run(_tmode(64, 32, 64, moving=0.5))


def test_matmul_transpose_mode_dtype_and_accumulate():
    with pytest.raises(emu.DtypeError, match=r"\[matmul-transpose\].*dst dtype float32.*bfloat16"):
        _run(_tmode(32, 16, 32, dst_dtype="float32"))
    with pytest.raises(emu.MatmulTileError, match=r"\[matmul-transpose\].*accumulate=True"):
        _run(_tmode(32, 16, 32, accumulate=True))
