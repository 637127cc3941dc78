"""The start-partition rule (NeuronCore architecture guide, "Data streaming"): the pure rule and its check
on every compute-engine instruction of the emulator (operands and destination; DMA exempt), including the
trace-only fast paths that cache validation."""

from __future__ import annotations

import pytest

from nki_kernels.emulator import start_partition as sp
from nki_kernels.emulator.errors import PartitionLimitError, StartPartitionError

pytestmark = pytest.mark.emulator


def _guide(n: int) -> set[int]:
    """The guide's three clauses, written out literally (independent of the module's modular form)."""
    if 64 < n <= 128:
        starts = {0}
    elif 32 < n <= 64:
        starts = {0, 64}
    elif 0 < n <= 32:
        starts = {0, 32, 64, 96}
    else:
        raise AssertionError(n)
    return {s for s in starts if s + n <= 128}


def test_rule_matches_the_guide_for_every_start_and_size() -> None:
    for n in range(1, 129):
        assert set(sp.allowed_starts(n)) == _guide(n), n
        for start in range(0, 128):
            assert sp.start_ok(start, n) == (start in _guide(n)), (start, n)


@pytest.mark.parametrize(
    ("n", "starts"),
    [
        (1, (0, 32, 64, 96)),
        (32, (0, 32, 64, 96)),  # boundary: 32 partitions are a quadrant access
        (33, (0, 64)),  # boundary: 33 is a half access
        (64, (0, 64)),
        (65, (0,)),  # boundary: more than 64 must start at 0
        (128, (0,)),
    ],
)
def test_rule_boundaries(n: int, starts: tuple[int, ...]) -> None:
    assert sp.allowed_starts(n) == starts
    for s in range(128):
        assert sp.start_ok(s, n) == (s in starts)


def test_rule_rejects_accesses_past_the_last_partition_and_bad_sizes() -> None:
    assert not sp.start_ok(96, 33) and not sp.start_ok(64, 65) and not sp.start_ok(-32, 8)
    with pytest.raises(ValueError, match="num_partitions"):
        sp.alignment(0)
    with pytest.raises(ValueError, match="num_partitions"):
        sp.alignment(129)
    with pytest.raises(ValueError, match="pmax"):
        sp.alignment(4, pmax=30)
    assert issubclass(StartPartitionError, PartitionLimitError)


def test_rule_text_names_the_clause() -> None:
    assert sp.rule_for(56) == "an access of 33-64 partitions must start at partition 0/64"
    assert sp.rule_for(96) == "an access of more than 64 partitions must start at partition 0"
    assert sp.rule_for(24) == "an access of 32 or fewer partitions must start at partition 0/32/64/96"


# ------------------------------------------------------------------ the rule on every compute instruction

from nki_kernels.emulator import isa as nisa  # noqa: E402
from nki_kernels.emulator import language as nl  # noqa: E402
from nki_kernels.emulator import run  # noqa: E402

N, F = 16, 32  # 16 partitions: legal starts 0/32/64/96, so 16 is illegal and 32 legal


def _maker(target: str, start: int):
    """``mk(name, free, dtype, buffer, parts)``: a fresh ``[parts, free]`` tile, except operand ``target``,
    which is the view of a 128-partition tile starting at partition ``start``."""

    def mk(name, free=F, dtype="float32", buf=None, parts=N):
        buf = nl.sbuf if buf is None else buf
        if name == target:
            return nl.ndarray((128, free), dtype, buffer=buf)[start : start + parts]
        return nl.ndarray((parts, free), dtype, buffer=buf)

    return mk


# instruction -> (operands it reads/writes, issue(mk))
CASES = {
    "tensor_copy": (("dst", "src"), lambda mk: nisa.tensor_copy(mk("dst"), mk("src"))),
    "memset": (("dst",), lambda mk: nisa.memset(mk("dst"), 0.0)),
    "tensor_tensor": (
        ("dst", "data1", "data2"),
        lambda mk: nisa.tensor_tensor(mk("dst"), mk("data1"), mk("data2"), nl.add),
    ),
    "tensor_scalar": (
        ("dst", "data", "operand0"),
        lambda mk: nisa.tensor_scalar(mk("dst"), mk("data"), nl.multiply, mk("operand0", free=1)),
    ),
    "scalar_tensor_tensor": (
        ("dst", "data", "operand1"),
        lambda mk: nisa.scalar_tensor_tensor(mk("dst"), mk("data"), nl.multiply, 2.0, nl.add, mk("operand1")),
    ),
    "tensor_reduce": (
        ("dst", "data"),
        lambda mk: nisa.tensor_reduce(mk("dst", free=1), nl.add, mk("data"), 1),
    ),
    "reciprocal": (("dst", "data"), lambda mk: nisa.reciprocal(mk("dst"), mk("data"))),
    "tensor_copy_predicated": (
        ("dst", "src", "predicate"),
        lambda mk: nisa.tensor_copy_predicated(mk("dst"), mk("src"), mk("predicate")),
    ),
    "tensor_scalar_reduce": (
        ("dst", "data", "reduce_res"),
        lambda mk: nisa.tensor_scalar_reduce(
            mk("dst"), mk("data"), nl.multiply, 2.0, nl.add, reduce_res=mk("reduce_res", free=1)
        ),
    ),
    "activation": (
        ("dst", "data", "bias", "reduce_res"),
        lambda mk: nisa.activation(
            mk("dst"),
            nl.exp,
            mk("data"),
            bias=mk("bias", free=1),
            reduce_op=nl.add,
            reduce_res=mk("reduce_res", free=1),
        ),
    ),  # fmt: skip
    "tensor_partition_reduce": (
        ("data",),
        lambda mk: nisa.tensor_partition_reduce(mk("dst", parts=1), nl.add, mk("data")),
    ),
    "iota": (("dst",), lambda mk: nisa.iota(mk("dst"), [[1, F]])),
    "affine_select": (
        ("dst", "on_true_tile"),
        lambda mk: nisa.affine_select(mk("dst"), [[1, F]], 0, mk("on_true_tile"), 0.0),
    ),
    "nc_transpose": (
        ("dst", "data"),
        lambda mk: nisa.nc_transpose(
            mk("dst", free=N, dtype="bfloat16", buf=nl.psum), mk("data", free=N, dtype="bfloat16")
        ),
    ),  # fmt: skip
    "nc_matmul": (
        ("dst", "stationary", "moving"),
        lambda mk: nisa.nc_matmul(
            mk("dst", free=F, buf=nl.psum),
            mk("stationary", free=N, dtype="bfloat16"),
            mk("moving", dtype="bfloat16"),
        ),
    ),  # fmt: skip
    "bn_stats": (("dst", "data"), lambda mk: nisa.bn_stats(mk("dst", free=6), mk("data"))),
    "bn_aggr": (("dst", "data"), lambda mk: nisa.bn_aggr(mk("dst", free=2), mk("data", free=6))),
    "tensor_tensor_scan": (
        ("dst", "data0", "data1"),
        lambda mk: nisa.tensor_tensor_scan(mk("dst"), mk("data0"), mk("data1"), 0.0, nl.multiply, nl.add),
    ),
    "range_select": (
        ("dst", "on_true_tile", "bound0"),
        lambda mk: nisa.range_select(
            mk("dst"),
            mk("on_true_tile"),
            nl.greater_equal,
            nl.less,
            mk("bound0", free=1),
            mk("bound1", free=1),
        ),
    ),
    "select_reduce": (
        ("dst", "predicate", "on_true"),
        lambda mk: nisa.select_reduce(mk("dst"), mk("predicate", dtype="uint8"), mk("on_true"), 0.0),
    ),
    "max8": (("dst", "src"), lambda mk: nisa.max8(mk("dst", free=8), mk("src"))),
    "nc_find_index8": (
        ("dst", "data", "vals"),
        lambda mk: nisa.nc_find_index8(mk("dst", free=8, dtype="uint32"), mk("data"), mk("vals", free=8)),
    ),
    "nc_match_replace8": (
        ("dst", "data", "vals"),
        lambda mk: nisa.nc_match_replace8(mk("dst"), mk("data"), mk("vals", free=8), 0.0),
    ),
    "nc_stream_shuffle": (
        ("dst", "src"),
        lambda mk: nisa.nc_stream_shuffle(mk("dst"), mk("src"), [i if i < N else 255 for i in range(32)]),
    ),
    "nl_unary_vector": (("data",), lambda mk: nl.floor(mk("data"))),
}
PAIRS = [(op, arg) for op, (args, _) in CASES.items() for arg in args]
TRACE_NAME = {"nl_unary_vector": "tensor_scalar"}


@pytest.mark.parametrize("trace_only", [False, True])
@pytest.mark.parametrize(("op", "arg"), PAIRS)
def test_every_compute_operand_is_checked(op: str, arg: str, trace_only: bool) -> None:
    """Each operand of each compute instruction: a 16-partition view at partition 32 passes, the same
    instruction with the same shapes at partition 16 raises, also when trace-only has already validated
    (and cached) the legal instance."""
    issue = CASES[op][1]

    def legal() -> None:
        issue(_maker(arg, 32))

    def kernel() -> None:
        issue(_maker(arg, 32))
        issue(_maker(arg, 16))

    _, tr = run(legal, trace_only=trace_only)
    assert tr.num_instructions >= 1
    name = TRACE_NAME.get(op, op)
    with pytest.raises(StartPartitionError) as ei:
        run(kernel, trace_only=trace_only)
    msg = str(ei.value)
    assert msg.startswith(f"[start-partition] {name}: operand {arg}="), msg
    assert "starts at partition 16 with 16 partitions" in msg
    assert "an access of 32 or fewer partitions must start at partition 0/32/64/96" in msg


def test_dma_is_exempt_and_partition_counts_pick_the_clause() -> None:
    def k() -> None:
        t = nl.ndarray((128, F), "float32", buffer=nl.sbuf)
        h = nl.ndarray((16, F), "float32", buffer=nl.shared_hbm)
        nisa.dma_copy(dst=t[16:32], src=h)  # DMA queues are not engines: any start
        nisa.dma_copy(dst=h, src=t[72:88])
        nisa.tensor_copy(t[64:128], t[0:64])  # 64 partitions at 64: legal
        nisa.tensor_copy(t[0:96], t[0:96])

    run(k)

    def bad(lo: int, hi: int):
        def k2() -> None:
            t = nl.ndarray((128, F), "float32", buffer=nl.sbuf)
            nisa.tensor_copy(t[0 : hi - lo], t[lo:hi])

        return k2

    with pytest.raises(
        StartPartitionError, match=r"src=.*starts at partition 32 with 33 partitions; an access of 33-64"
    ):
        run(bad(32, 65))
    with pytest.raises(
        StartPartitionError, match=r"starts at partition 32 with 65 partitions; an access of more than 64"
    ):
        run(bad(32, 97))
    run(bad(64, 128))  # 64 at 64 is legal; 65 partitions cannot start at 64 (they would pass 128)


def test_trace_only_fast_path_keys_on_start_partition() -> None:
    """The trace-only validation cache of tensor_copy / nc_transpose / nc_matmul: thousands of legal issues
    at partition 0 are counted without re-checking, and the first one at an illegal start still raises."""

    def kernel(start: int):
        def k() -> None:
            src = nl.ndarray((128, 64), "bfloat16", buffer=nl.sbuf)
            ps = nl.ndarray((128, 64), "float32", buffer=nl.psum)
            for _ in range(1000):
                nisa.tensor_copy(ps[0:48], src[0:48])
                nisa.nc_matmul(ps[0:48, 0:48], src[0:48, 0:48], src[0:48, 0:48])
            nisa.nc_matmul(ps[0:48, 0:48], src[start : start + 48, 0:48], src[start : start + 48, 0:48])

        return k

    _, tr = run(kernel(64), trace_only=True, hw=None)
    assert tr.count(op="nc_matmul") == 1001 and tr.count(op="tensor_copy") == 1000
    with pytest.raises(
        StartPartitionError, match=r"nc_matmul: operand stationary=.*starts at partition 32 with 48"
    ):
        run(kernel(32), trace_only=True)


@pytest.mark.parametrize("n", [1, 31, 32, 33, 63, 64, 65, 127, 128])
def test_emulator_accepts_exactly_the_guide_starts_at_the_boundaries(n: int) -> None:
    """Through the emulator (a VectorE copy whose dst is the view): every start the guide allows passes,
    every other start raises."""
    for start in range(0, 129 - n):

        def k(start: int = start) -> None:
            t = nl.ndarray((128, 4), "float32", buffer=nl.sbuf)
            nisa.memset(t[start : start + n], 0.0)

        if start in _guide(n):
            run(k, trace_only=True)
        else:
            with pytest.raises(
                StartPartitionError, match=rf"starts at partition {start} with {n} partitions"
            ):
                run(k, trace_only=True)
