"""Shared pieces of the ``neuron`` test tier (tests/test_neuron_*.py): find the device or skip with the
reason (:func:`device_or_skip`, behind the ``neuron_device`` fixture of tests/conftest.py), move tensors
there and back, compare against the references with the tolerance rule of ``tests/numerics.py``.

The tier runs every public op of :mod:`nki_kernels.ops` with ``backend="neuron"`` (the real ``nki``
package) on tensors placed on ``torch_xla.device()``, the documented PyTorch launch of an ``@nki.jit``
kernel (Neuron docs, ``nki/examples/getting_started_torch.py`` and the ``nki.jit`` API page:
https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/api/generated/nki.jit.html). References and
baselines run on CPU. Nothing here runs at import: the device is looked for by the ``neuron_device``
fixture, so collecting these files on a machine without a device costs nothing and each test reports
``SKIPPED (neuron tier not run: <what is missing>)``.

Run on a trn2: ``python -m pytest -m neuron`` (docs/neuron.md).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from nki_kernels.neuron_probe import probe
from tests.numerics import assert_within, reference_error, worst_of

SKIP_PREFIX = "neuron tier not run"
"""Every skip of the tier starts with this, followed by what is missing."""


LNC_ENV = "NEURON_LOGICAL_NC_CONFIG"
"""The runtime's logical-core setting; a launch's ``kernel[lnc]`` must match it (``nki.jit`` API page).
The ops launch every kernel with lnc=1, while trn2's default is LNC=2 (Neuron docs, "Logical NeuronCore
configuration"), so the tier runs with ``NEURON_LOGICAL_NC_CONFIG=1``."""


def device_or_skip() -> Any:
    """The ``torch_xla`` device when a Neuron device, the real ``nki`` and ``torch_xla`` are all present;
    otherwise ``pytest.skip`` with the reason.

    Sets ``NEURON_LOGICAL_NC_CONFIG=1`` when unset, before the first device use (as the NKI profiling
    guide's example does in-process); any other value fails the tier with the reason.
    """
    reason = probe().reason(("device", "nki", "torch_xla"))
    if reason:
        pytest.skip(f"{SKIP_PREFIX}: {reason}")
    lnc = os.environ.setdefault(LNC_ENV, "1")
    if lnc != "1":
        pytest.fail(f"{LNC_ENV}={lnc}: the ops launch kernels with lnc=1; run the tier with {LNC_ENV}=1")
    import torch_xla

    return torch_xla.device()


def randn(shape: Sequence[int], seed: int) -> torch.Tensor:
    """Unit-normal fp32 CPU tensor (the scale the numerics floors assume)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def to_dev(xs: Sequence[torch.Tensor], dtype: torch.dtype, device: Any) -> list[torch.Tensor]:
    """Cast to ``dtype`` on CPU (the rounding the reference error measures), then move to ``device``."""
    return [x.to(dtype).contiguous().to(device) for x in xs]


def cpu(x: Any) -> Any:
    """A result (tensor or tuple of tensors) back on CPU."""
    if isinstance(x, torch.Tensor):
        return x.cpu()
    return tuple(cpu(t) for t in x)


def check_against_reference(
    ref_fn: Callable[..., Any],
    op_fn: Callable[..., Any],
    tensors: Sequence[torch.Tensor],
    dtype: torch.dtype,
    device: Any,
    what: str,
    out_dtypes: Sequence[torch.dtype] | None = None,
) -> float:
    """``op_fn(*tensors in dtype on device)`` against ``ref_fn(*tensors)`` with the project's rule.

    ``tensors``: fp32 CPU tensors (every other argument is closed over by the two callables; ``op_fn``
    calls a public op with ``backend="neuron"``). The baseline and the reference's own ``dtype`` error come
    from :func:`tests.numerics.reference_error` on CPU; every device result must be within
    ``2 x ref_err + FLOORS[dtype]`` of the baseline (``assert_within``), the rule the emulator tests use.
    ``out_dtypes``: expected dtype of each result (default: all ``dtype``). Returns the largest error.
    """
    ref_err, base = reference_error(ref_fn, tensors, dtype)
    got = cpu(op_fn(*to_dev(tensors, dtype, device)))
    outs = (got,) if isinstance(got, torch.Tensor) else tuple(got)
    bases = (base,) if isinstance(base, torch.Tensor) else tuple(base)
    want = list(out_dtypes) if out_dtypes is not None else [dtype] * len(bases)
    assert len(outs) == len(bases) == len(want), f"{what}: {len(outs)} results vs {len(bases)} expected"
    worst = 0.0
    for i, (o, b, dt) in enumerate(zip(outs, bases, want)):
        assert o.dtype == dt and tuple(o.shape) == tuple(b.shape), (
            f"{what}[{i}]: got {o.dtype} {tuple(o.shape)}, expected {dt} {tuple(b.shape)}"
        )
        worst = worst_of(worst, assert_within(o, b, dtype, ref_err, what=f"{what}[{i}] on device"))
    return worst
