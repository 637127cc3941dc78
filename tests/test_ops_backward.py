"""What ``backward()`` does through each op of ``torch.ops.nki_ardiff``, as the README's limits table says.

* ``ops.attention`` has a backward: the exact softmax-attention gradient, whatever backend ran the forward
  (checked here against an independent softmax attention differentiated in float64, on the reference and
  the emulator backends; tests/test_demo_train.py checks it with the lse output too).
* Every other functional op raises at ``backward()`` naming itself (torch's message for a custom op without
  an autograd formula), never a silent ``None`` gradient.
* The KV-cache ops mutate their caches in place (torch registers no autograd for a mutating custom op, so a
  write with grad mode on would silently drop k/v's gradient): they refuse a tensor requiring grad on entry,
  naming the op and the argument, and run as usual under ``torch.no_grad()``.
* ``rope_tables`` takes no floating-point tensor, so nothing can flow through it.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from nki_kernels import ops
from tests.numerics import assert_within, reference_error


def _x(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).requires_grad_(True)


def _softmax_attention_grads(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """d/d(q, k, v) of sum(w * softmax(q k^T / sqrt(D)) v), [B, L, H, D] layout, in the inputs' dtype."""
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    s = torch.einsum("bqhd,bkhd->bhqk", leaves[0], leaves[1]) / math.sqrt(q.shape[-1])
    out = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), leaves[2])
    return torch.autograd.grad((out * w).sum(), leaves)


@pytest.mark.parametrize("backend", ["reference", "emulator"])
def test_attention_backward_is_the_softmax_gradient(backend: str) -> None:
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 9, 2, 16, generator=g) for _ in range(3))
    w = torch.randn(1, 9, 2, 16, generator=g)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    (ops.attention(*leaves, backend=backend) * w).sum().backward()  # type: ignore[operator]
    # Baseline: the float64 gradient; tolerance from the same formula's own fp32 error (tests/numerics.py).
    ref_err, baseline = reference_error(_softmax_attention_grads, [q, k, v, w], torch.float32)
    got = tuple(t.grad for t in leaves)
    assert all(t is not None for t in got)
    assert_within(got, baseline, torch.float32, ref_err, what=f"attention grad ({backend})")


_Q = (1, 8, 2, 16)
NO_BACKWARD: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "attention_segments": lambda x: ops.attention_segments(
        x, _x(*_Q, seed=1), _x(*_Q, seed=2), [(0, 4), (4, 4)]
    ),
    "attention_block_table": lambda x: ops.attention_block_table(
        x, [_x(*_Q, seed=1)], [_x(*_Q, seed=2)], torch.tensor([[[0, 0], [0, 1]]], dtype=torch.int32), [8], 4
    ),
    "rope3d": lambda x: ops.rope3d(x, _x(*_Q, seed=1), (2, 2, 2), 0)[0],
    "rope3d_positions": lambda x: ops.rope3d_positions(x, _x(*_Q, seed=1), (2, 2, 2), torch.tensor([0, 3]))[
        0
    ],
    "rope3d_tables": lambda x: ops.rope3d_tables(x, _x(*_Q, seed=1), *ops.rope_tables((2, 2, 2), 16, 0))[0],
    "rope3d_tables_one": lambda x: ops.rope3d_tables_one(x, *ops.rope_tables((2, 2, 2), 16, 0)),
    "rope3d_positions_one": lambda x: ops.rope3d_positions_one(x, (2, 2, 2), torch.tensor([0, 3])),
    "linear": lambda x: ops.linear(x.reshape(8, 32), torch.randn(32, 4)),
    "linear_fp8": lambda x: ops.linear_fp8(x.reshape(8, 32), *ops.quantize_weight_fp8(torch.randn(32, 4))),
    "conv3d_causal": lambda x: ops.conv3d_causal(
        x.reshape(1, 4, 2, 4, 8)[..., :4].contiguous(), ops.conv_weight_taps(torch.randn(4, 4, 3, 3, 3))
    )[0],
    "adaln_norm_modulate": lambda x: ops.adaln_norm_modulate(
        x.reshape(1, 8, 32), torch.zeros(1, 32), torch.zeros(1, 32)
    ),
    "gate_residual": lambda x: ops.gate_residual(
        x.reshape(1, 8, 32), torch.randn(1, 8, 32), torch.ones(1, 32)
    ),
    "gate_residual_adaln": lambda x: ops.gate_residual_adaln(
        x.reshape(1, 8, 32),
        torch.randn(1, 8, 32).bfloat16(),
        torch.ones(1, 32),
        torch.zeros(1, 32),
        torch.zeros(1, 32),
    )[0],
    "rms_norm": lambda x: ops.rms_norm(x.reshape(1, 8, 32), torch.ones(32)),
    "gelu_tanh": lambda x: ops.gelu_tanh(x.reshape(1, 8, 32)),
}


@pytest.mark.parametrize("name", sorted(NO_BACKWARD))
def test_other_ops_refuse_backward_naming_the_op(name: str) -> None:
    out = NO_BACKWARD[name](_x(*_Q))
    assert out.requires_grad  # the graph reaches the op: backward() gets there and must raise, not skip it
    with pytest.raises(RuntimeError, match=rf"nki_ardiff\.{name}\.default but no autograd formula"):
        out.float().sum().backward()


KV_OPS: dict[str, Callable[..., None]] = {
    "kv_cache_write": lambda ck, cv, k, v: ops.kv_cache_write(ck, cv, k, v, 1),
    "kv_cache_slide": lambda ck, cv, k, v: ops.kv_cache_slide(ck, cv, k, v, 0),
    "kv_cache_write_at": lambda ck, cv, k, v: ops.kv_cache_write_at(ck, cv, k, v, torch.tensor(1)),
}


@pytest.mark.parametrize("arg", ["cache_k", "cache_v", "k", "v"])
@pytest.mark.parametrize("name", sorted(KV_OPS))
def test_kv_cache_ops_refuse_grad_naming_op_and_argument(name: str, arg: str) -> None:
    tensors = {"cache_k": torch.zeros(1, 16, 2, 16), "cache_v": torch.zeros(1, 16, 2, 16)}
    tensors |= {"k": torch.randn(1, 8, 2, 16), "v": torch.randn(1, 8, 2, 16)}
    leaf = tensors[arg].requires_grad_(True)
    tensors[arg] = leaf * 1.0 if arg.startswith("cache") else leaf  # a cache in the graph, not a leaf
    before = {n: t.detach().clone() for n, t in tensors.items()}
    with pytest.raises(RuntimeError, match=rf"^{name} has no backward .*: {arg} requires grad"):
        KV_OPS[name](*tensors.values())
    for n, t in tensors.items():  # refused before anything was written
        assert torch.equal(t.detach(), before[n]), n
    with torch.no_grad():  # inference: the same tensors are accepted and written
        KV_OPS[name](*tensors.values())
    want_k = tensors["k"].detach()
    got_k = tensors["cache_k"].detach()[:, 8:16]  # slot 1 of T=8 / the slid-in tail: the same tokens
    assert torch.equal(got_k, want_k)


def test_every_registered_op_is_covered() -> None:
    """A new op must be placed in one of the groups above (and its backward story documented)."""
    registered = {n for n in dir(torch.ops.nki_ardiff) if not n.startswith("_") and n != "name"}
    no_float_input = {"rope_tables"}
    cos, sin = ops.rope_tables((2, 2, 2), 16, 0)
    assert not cos.requires_grad and not sin.requires_grad
    assert registered == {"attention"} | set(NO_BACKWARD) | set(KV_OPS) | no_float_input
