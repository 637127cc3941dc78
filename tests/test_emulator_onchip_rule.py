"""The on-chip operand rule (``isa._rules._onchip``) holds for every on-chip instruction, fast paths included.

The hot instructions inline the rule's passing case (tagged ``# fast path of _rules._onchip``); a rule added
to ``_onchip`` would be skipped wherever such a condition passes. Two guards:

* a table of every on-chip instruction of ``nki.isa`` with one legal call each: every tensor operand is
  replaced in turn by an HBM tensor (expects :class:`MemorySpaceError`) and by a 129-partition operand
  (expects :class:`PartitionLimitError`), with values and trace-only (after a legal warm-up call, so the
  trace-only signature cache holds a passing entry of the same instruction);
* a source check that every inlined condition is tagged and is exactly the documented pass condition of
  ``_onchip``, followed by ``_onchip`` on the same operand.
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from nki_kernels.emulator import (
    MatmulTileError,
    MemorySpaceError,
    PartitionLimitError,
    ShapeMismatchError,
    run,
)
from nki_kernels.emulator import isa as nisa
from nki_kernels.emulator import language as nl
from nki_kernels.emulator.hw import TRN2
from nki_kernels.emulator.tensor import NkiTensor

pytestmark = pytest.mark.emulator

P, F = 32, 64
f32, u8, u32, i32 = nl.float32, nl.uint8, nl.uint32, nl.int32

Make = Callable[..., Any]
"""``t(arg, shape, dtype=f32, buffer=nl.sbuf)``: the operand named ``arg`` (a bad one when under test)."""

# instruction -> (its on-chip tensor operands, one legal call building each operand through ``t``)
TABLE: dict[str, tuple[tuple[str, ...], Callable[[Make], Any]]] = {
    "tensor_tensor": (
        ("dst", "data1", "data2"),
        lambda t: nisa.tensor_tensor(t("dst", (P, F)), t("data1", (P, F)), t("data2", (P, F)), nl.add),
    ),
    "tensor_scalar": (
        ("dst", "data", "operand0"),
        lambda t: nisa.tensor_scalar(t("dst", (P, F)), t("data", (P, F)), nl.multiply, t("operand0", (P, 1))),
    ),
    "scalar_tensor_tensor": (
        ("dst", "data", "operand0", "operand1"),
        lambda t: nisa.scalar_tensor_tensor(
            t("dst", (P, F)),
            t("data", (P, F)),
            nl.multiply,
            t("operand0", (P, 1)),
            nl.add,
            t("operand1", (P, F)),
        ),
    ),
    "tensor_reduce": (
        ("dst", "data"),
        lambda t: nisa.tensor_reduce(t("dst", (P, 1)), nl.maximum, t("data", (P, F)), axis=1),
    ),
    "tensor_partition_reduce": (
        ("dst", "data"),
        lambda t: nisa.tensor_partition_reduce(t("dst", (1, F)), nl.add, t("data", (P, F))),
    ),
    "tensor_scalar_reduce": (
        ("dst", "data", "reduce_res"),
        lambda t: nisa.tensor_scalar_reduce(
            t("dst", (P, F)), t("data", (P, F)), nl.multiply, 2.0, nl.add, reduce_res=t("reduce_res", (P, 1))
        ),
    ),
    "tensor_copy_predicated": (
        ("dst", "src", "predicate"),
        lambda t: nisa.tensor_copy_predicated(t("dst", (P, F)), t("src", (P, F)), t("predicate", (P, F), u8)),
    ),
    "reciprocal": (("dst", "data"), lambda t: nisa.reciprocal(t("dst", (P, F)), t("data", (P, F)))),
    "tensor_copy": (("dst", "src"), lambda t: nisa.tensor_copy(t("dst", (P, F)), t("src", (P, F)))),
    "memset": (("dst",), lambda t: nisa.memset(t("dst", (P, F)), 0.0)),
    "activation": (
        ("dst", "data", "bias", "reduce_res"),
        lambda t: nisa.activation(
            t("dst", (P, F)),
            nl.exp,
            t("data", (P, F)),
            bias=t("bias", (P, 1)),
            reduce_op=nl.add,
            reduce_res=t("reduce_res", (P, 1)),
        ),
    ),
    "activation_reduce": (
        ("dst", "data", "reduce_res"),
        lambda t: nisa.activation_reduce(
            t("dst", (P, F)), nl.exp, t("data", (P, F)), nl.add, t("reduce_res", (P, 1))
        ),
    ),
    "nc_matmul": (
        ("dst", "stationary", "moving"),
        lambda t: nisa.nc_matmul(
            t("dst", (P, F), buffer=nl.psum), t("stationary", (P, P)), t("moving", (P, F)), accumulate=False
        ),
    ),
    "nc_transpose": (
        ("dst", "data"),
        lambda t: nisa.nc_transpose(t("dst", (F, P), buffer=nl.psum), t("data", (P, F))),
    ),
    "iota": (("dst",), lambda t: nisa.iota(t("dst", (P, F), i32), [[1, F]], offset=0, channel_multiplier=F)),
    "affine_select": (
        ("dst", "on_true_tile"),
        lambda t: nisa.affine_select(
            t("dst", (P, F)), [[-1, F]], 1, t("on_true_tile", (P, F)), 0.0, cmp_op=nl.greater_equal
        ),
    ),
    "bn_stats": (("dst", "data"), lambda t: nisa.bn_stats(t("dst", (P, 6)), t("data", (P, F)))),
    "bn_aggr": (("dst", "data"), lambda t: nisa.bn_aggr(t("dst", (P, 2)), t("data", (P, 6)))),
    "tensor_tensor_scan": (
        ("dst", "data0", "data1"),
        lambda t: nisa.tensor_tensor_scan(
            t("dst", (P, F)), t("data0", (P, F)), t("data1", (P, F)), 0.0, nl.multiply, nl.add
        ),
    ),
    "tensor_scalar_cumulative": (
        ("dst", "src"),
        lambda t: nisa.tensor_scalar_cumulative(t("dst", (P, F)), t("src", (P, F)), nl.add, nl.add, 1.0),
    ),
    "range_select": (
        ("dst", "on_true_tile", "bound0", "bound1", "reduce_res"),
        lambda t: nisa.range_select(
            t("dst", (P, F)),
            t("on_true_tile", (P, F)),
            nl.greater_equal,
            nl.less,
            t("bound0", (P, 1)),
            t("bound1", (P, 1)),
            reduce_res=t("reduce_res", (P, 1)),
        ),
    ),
    "select_reduce": (
        ("dst", "predicate", "on_true", "reduce_res"),
        lambda t: nisa.select_reduce(
            t("dst", (P, F)),
            t("predicate", (P, F), u8),
            t("on_true", (P, F)),
            0.0,
            reduce_res=t("reduce_res", (P, 1)),
            reduce_op=nl.maximum,
        ),
    ),
    "max8": (("dst", "src"), lambda t: nisa.max8(t("dst", (P, 8)), t("src", (P, F)))),
    "nc_find_index8": (
        ("dst", "data", "vals"),
        lambda t: nisa.nc_find_index8(t("dst", (P, 8), u32), t("data", (P, F)), t("vals", (P, 8))),
    ),
    "nc_match_replace8": (
        ("dst", "data", "vals", "dst_idx"),
        lambda t: nisa.nc_match_replace8(
            t("dst", (P, F)), t("data", (P, F)), t("vals", (P, 8)), 0.0, dst_idx=t("dst_idx", (P, 8), u32)
        ),
    ),
    "nc_stream_shuffle": (
        ("dst", "src"),
        lambda t: nisa.nc_stream_shuffle(t("dst", (P, F)), t("src", (P, F)), list(range(32))),
    ),
    "nc_n_gather": (
        ("dst", "data", "indices"),
        lambda t: nisa.nc_n_gather(t("dst", (P, 16)), t("data", (P, F)), t("indices", (P, 16), u32)),
    ),
    "local_gather": (
        ("dst", "src_buffer", "index"),
        lambda t: nisa.local_gather(t("dst", (P, 32)), t("src_buffer", (P, F)), t("index", (P, 2), "uint16")),
    ),
    "nonzero_with_count": (
        ("dst", "src"),
        lambda t: nisa.nonzero_with_count(t("dst", (P, F + 1), i32), t("src", (P, F))),
    ),
}

NOT_ON_CHIP = {
    "dma_copy": "DMA: HBM operands are its purpose",
    "dma_transpose": "DMA: HBM operands are its purpose",
    "dma_descriptors": "a DMA query, no instruction",
    "sendrecv": "core-to-core DMA with its own SBUF-only rule",
    "dma_compute": "DMA: HBM operands are allowed (tests/test_emulator_isa_dma_gather.py)",
    "quantize_mx": "NeuronCore-v4 only, refused on trn2 first (tests/test_emulator_isa_mx.py)",
    "nc_matmul_mx": "NeuronCore-v4 only, refused on trn2 first (tests/test_emulator_isa_mx.py)",
    "core_barrier": "its data is a shared HBM tensor",
    "register_alloc": "registers",
    "register_load": "registers (a one-element tensor in any memory)",
    "register_move": "registers",
    "register_store": "registers (a one-element tensor in any memory)",
    "get_nc_version": "no operands",
    "get_nc_sub_version": "no operands",
}

CASES = [(op, arg) for op, (args, _) in TABLE.items() for arg in args]

PARTITION_RULE = (PartitionLimitError, r"\[partition-limit\].*{arg}.*129")
"""The error of a 129-partition operand: the on-chip rule's, except where the instruction has its own
partition rule (nc_matmul: the contraction dim of its operands, and dst must be ``[M, N]``)."""
OWN_PARTITION_RULE = {
    ("nc_matmul", "stationary"): (MatmulTileError, r"\[matmul-contraction\].*stationary \[129, "),
    ("nc_matmul", "moving"): (MatmulTileError, r"\[matmul-contraction\].*moving \[129, "),
    ("nc_matmul", "dst"): (ShapeMismatchError, r"\[matmul-dst\] nc_matmul: dst\[129, "),
}


def _factory(target: str | None, bad: str | None) -> Make:
    def t(arg: str, shape: tuple[int, ...], dtype: Any = f32, buffer: Any = None) -> Any:
        buffer = nl.sbuf if buffer is None else buffer
        if arg != target:
            return nl.ndarray(shape, dtype, buffer=buffer)
        if bad == "hbm":  # named, so a message that names the tensor rather than the argument still shows it
            return nl.ndarray(shape, dtype, buffer=nl.shared_hbm, name=f"bad_{arg}")
        # a view of more partitions than the target has: allocation refuses one, so build it directly
        return NkiTensor((TRN2.pmax + 1, *shape[1:]), dtype, buffer=buffer, name=f"bad_{arg}")

    return t


def test_the_table_covers_every_on_chip_instruction() -> None:
    instructions = {n for n in nisa.__all__ if inspect.isfunction(getattr(nisa, n))}
    assert set(TABLE) | set(NOT_ON_CHIP) == instructions
    assert not set(TABLE) & set(NOT_ON_CHIP)
    for op, (args, _) in TABLE.items():  # every NkiTensor-typed parameter is in the table
        params = inspect.signature(getattr(nisa, op)).parameters
        typed = {n for n, p in params.items() if "NkiTensor" in str(p.annotation)}
        assert typed <= set(args), (op, typed - set(args))


@pytest.mark.parametrize("trace_only", [False, True], ids=["values", "trace_only"])
def test_every_legal_call_passes(trace_only: bool) -> None:
    def k() -> None:
        for _, call in TABLE.values():
            call(_factory(None, None))

    run(k, trace_only=trace_only)


@pytest.mark.parametrize("trace_only", [False, True], ids=["values", "trace_only"])
@pytest.mark.parametrize("bad", ["hbm", "partitions"])
@pytest.mark.parametrize(("op", "arg"), CASES, ids=[f"{o}-{a}" for o, a in CASES])
def test_bad_operand_is_rejected(op: str, arg: str, bad: str, trace_only: bool) -> None:
    """An HBM operand raises the memory-space rule; a 129-partition one the partition rule (or the
    instruction's own partition rule, :data:`OWN_PARTITION_RULE`)."""
    call = TABLE[op][1]

    def k() -> None:
        call(_factory(None, None))  # warm-up: a passing signature of the same instruction
        call(_factory(arg, bad))

    if bad == "hbm":
        err, pattern = MemorySpaceError, r"\[memory-space\].*{arg}"
    else:
        err, pattern = OWN_PARTITION_RULE.get((op, arg), PARTITION_RULE)
    with pytest.raises(err, match=pattern.format(arg=arg)):
        run(k, trace_only=trace_only)


# ------------------------------------------------------------------------------------- the inlined conditions
TAG = "# fast path of _rules._onchip"
ISA_DIR = Path(nisa.__file__).parent


def _pass_condition(v: str) -> list[str]:
    """The documented pass condition of ``_onchip`` for operand ``v`` (its docstring)."""
    return [
        f"type({v}) is NkiTensor",
        f"{v}._st.buffer.on_chip",
        f"{v}.shape[0] <= pmax",
        f"{v}.offset < {v}._st.size // {v}._st.shape[0]",
    ]


def _fast_paths() -> list[tuple[str, int, ast.If]]:
    """Every ``if not (type(x) is NkiTensor and ...)`` in the isa package (an inlined operand check)."""
    out = []
    for path in sorted(ISA_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.If)
                and isinstance(node.test, ast.UnaryOp)
                and isinstance(node.test.op, ast.Not)
                and isinstance(node.test.operand, ast.BoolOp)
                and ast.unparse(node.test.operand.values[0]).startswith("type(")
            ):
                out.append((path.name, node.lineno, node))
    return out


def test_every_inlined_on_chip_condition_is_tagged_and_exact() -> None:
    found = _fast_paths()
    assert len(found) == 18  # tensor_copy, nc_transpose, activation, and the VectorE ALU instructions
    for name, line, node in found:
        src_line = (ISA_DIR / name).read_text().splitlines()[line - 1]
        assert src_line.rstrip().endswith(TAG), f"{name}:{line} lacks the tag"
        terms = [ast.unparse(v) for v in node.test.operand.values]
        var = terms[0].removeprefix("type(").split(")")[0]
        assert terms == _pass_condition(var), f"{name}:{line}: {terms}"
        assert len(node.body) == 1 and not node.orelse, f"{name}:{line}"
        call = ast.unparse(node.body[0])
        assert call.startswith(f"_onchip({var}, ") and call.endswith(f", '{var}', launch)"), f"{name}:{line}"


def test_every_tag_marks_an_inlined_condition() -> None:
    tagged = [
        (path.name, i + 1)
        for path in sorted(ISA_DIR.glob("*.py"))
        for i, line in enumerate(path.read_text().splitlines())
        if line.rstrip().endswith(TAG)
    ]
    assert sorted(tagged) == sorted((name, line) for name, line, _ in _fast_paths())
