"""Every public op and its reference keep the same parameter names, in the same order (the op set rule);
the op may add only the documented extras."""

from __future__ import annotations

import inspect

import pytest

import reference.attention
import reference.conv3d
import reference.elementwise
import reference.kv_cache
import reference.linear
import reference.rope3d
from nki_kernels import ops

# op -> (reference function, extra parameters the op documents beyond the reference's)
PAIRS = {
    "rope3d": (reference.rope3d.rope3d, {"max_positions", "backend"}),
    "rope_tables": (reference.rope3d.rope_tables, {"device"}),
    "rope3d_tables": (reference.rope3d.rope3d_tables, {"backend"}),
    "rope3d_tables_one": (reference.rope3d.rope3d_tables_one, {"backend"}),
    "attention": (reference.attention.attention, {"backend"}),
    "attention_segments": (reference.attention.attention_segments, {"backend"}),
    "attention_block_table": (reference.attention.attention_block_table, {"backend"}),
    "kv_cache_write": (reference.kv_cache.kv_cache_write, {"backend"}),
    "kv_cache_slide": (reference.kv_cache.kv_cache_slide, {"backend"}),
    "linear": (reference.linear.linear, {"backend"}),
    "linear_fp8": (reference.linear.linear_fp8, {"backend"}),
    "conv3d_causal": (reference.conv3d.conv3d_causal, {"backend"}),
    "adaln_norm_modulate": (reference.elementwise.adaln_norm_modulate, {"backend"}),
    "gate_residual": (reference.elementwise.gate_residual, {"backend"}),
    "rms_norm": (reference.elementwise.rms_norm, {"backend"}),
    "gelu_tanh": (reference.elementwise.gelu_tanh, {"backend"}),
    "gate_residual_adaln": (reference.elementwise.gate_residual_adaln, {"backend"}),
}
# static-shape variants share the reference of their dynamic op (documented in their docstrings)
VARIANTS = {
    "rope3d_positions": "rope3d",
    "rope3d_positions_one": "rope3d_tables_one",
    "kv_cache_write_at": "kv_cache_write",
}
HELPERS = {"check_segments", "conv_weight_taps", "has_kernel", "quantize_weight_fp8", "resolve_backend"}


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_op_and_reference_share_parameter_names(name: str) -> None:
    ref, extras = PAIRS[name]
    op_params = [p for p in inspect.signature(getattr(ops, name)).parameters if p not in extras]
    assert op_params == list(inspect.signature(ref).parameters), name


def test_every_public_op_is_paired() -> None:
    public = {n for n in ops.__all__ if callable(getattr(ops, n)) and not isinstance(getattr(ops, n), type)}
    assert public == set(PAIRS) | set(VARIANTS) | HELPERS
