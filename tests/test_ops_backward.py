"""What ``backward()`` does through the ops, as the README's limits table says: ``ops.attention`` has the
exact softmax-attention gradient (checked against float64 autograd in tests/test_demo_train.py; here its
gradient reaches q, k and v), every other op raises naming itself (inference only, never a silent None)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from nki_kernels import ops


def _x(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).requires_grad_(True)


def test_attention_backward_reaches_q_k_v() -> None:
    q, k, v = _x(1, 8, 2, 16, seed=1), _x(1, 8, 2, 16, seed=2), _x(1, 8, 2, 16, seed=3)
    ops.attention(q, k, v).square().sum().backward()
    for t in (q, k, v):
        assert t.grad is not None and bool(torch.isfinite(t.grad).all()) and float(t.grad.abs().max()) > 0


NO_BACKWARD: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "rope3d": lambda x: ops.rope3d(x, x.detach().clone(), (2, 2, 2), 0)[0],
    "linear": lambda x: ops.linear(x.reshape(8, 32), torch.randn(32, 4)),
    "rms_norm": lambda x: ops.rms_norm(x.reshape(1, 8, 32), torch.ones(32)),
    "gelu_tanh": lambda x: ops.gelu_tanh(x.reshape(1, 8, 32)),
}


@pytest.mark.parametrize("name", sorted(NO_BACKWARD))
def test_other_ops_refuse_backward_naming_the_op(name: str) -> None:
    out = NO_BACKWARD[name](_x(1, 8, 2, 16))
    with pytest.raises(RuntimeError, match=rf"nki_ardiff\.{name}\.default but no autograd formula"):
        out.sum().backward()
