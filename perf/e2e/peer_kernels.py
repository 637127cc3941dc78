"""Kernel provider of the measured peer's rows: its own attention and D-major layout changes (*modelled*).

The peer (github.com/yahavb/rolling_forcing) runs its own NKI attention kernels, not this project's. Pricing
its configuration with our attention kernel (:class:`~perf.e2e.kernels.TracedKernels`) measures our kernel,
not the end-to-end accounting. :class:`PeerKernels` prices the peer rows (and only them, see
:func:`perf.e2e.run.run_model`) with:

* ``attention`` (self-attention): :func:`perf.e2e.peer_attention.peer_attention_kernel` (the structure of
  the peer's ``wan_flash_self_attn``) traced at the per-core shape (q ``[H, d, Lq]``, k
  ``[H, d, Lk_buf]``, v ``[H, Lk_buf, d]``, ``Lk`` keys attended of the ``Lk_buf = padded_keys(Lk)``-wide
  buffer) with its event log and priced by cost model v2's schedule at both ends (``profile_range``);
* ``attention_layout``: the permutes the peer's XLA graph makes before every attention call
  (``models/dit_attention.py`` ``_attend`` and ``models/dit_layers.py``: q and k to D-major, v per head,
  each ``.contiguous()``): :func:`perf.e2e.peer_attention.dmajor_layout_kernel` traced and priced the same
  way. The self-attention permutes cover the whole padded K/V buffer (the peer permutes ``buffer_k[0]``,
  ``Lk_buf`` rows); the cross-attention ones the 512 text keys. They are XLA ops inside the peer's graphs,
  not NKI kernel calls, so the chunk model charges them no ``kernel_fixed_s``;
* ``cross_attention``: the peer's ``wan_cross_attn`` has the same design over the 512 text keys (one
  section), but there the emulator's 16-row hardware-DGE transpose rule splits each of its P^T DMAs
  (``[128 q, 512 k]``, 1 KiB per destination partition) into 8 of 128 B, which cost model v2 prices ~10x
  dearer (its descriptor sizes; ``perf/e2e/peer_attention.py``). So by default the cross-attention is
  priced by ``base`` (our kernel, TensorE P^T for a 512-key chunk); ``cross_with_peer_kernel=True``
  prices it with the peer-structure kernel (the upper end of that artefact);
* RoPE and the KV write: the wrapped ``base`` provider (our kernels; the peer's RoPE / cache-copy kernels
  are not re-implemented).

Heads beyond ``max_heads`` are traced at the largest divisor ``<= max_heads`` and scaled (heads are
independent). A trace that fails falls back to ``base`` and says so in ``source``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from perf.e2e.kernels import KernelCost, KernelProvider, _profile_cost

__all__ = ["PeerKernels"]


def _heads_traced(heads: int, max_heads: int) -> int:
    """Largest divisor of ``heads`` that is ``<= max_heads``."""
    return max(x for x in range(1, min(heads, max_heads) + 1) if heads % x == 0)


@dataclass
class PeerKernels:
    """Per-core kernel costs of the peer's configuration (module docstring). ``base`` prices RoPE and the
    KV write and is the labelled fallback; ``profile`` maps a ``(kernel, *args)`` trace to the cost-model
    profile pair ``(low, high)`` (default: trace-only emulator run with the event log, ``profile_range``
    with the schedule)."""

    base: KernelProvider
    max_heads: int = 3
    name: str = "peer"
    cross_with_peer_kernel: bool = False
    profile: Callable[..., tuple[Any, Any]] | None = None
    _cache: dict[tuple[Any, ...], KernelCost] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.max_heads < 1:
            raise ValueError(f"PeerKernels.max_heads must be >= 1, got {self.max_heads}")
        if self.profile is None:
            from nki_kernels.emulator import run
            from nki_kernels.emulator.cost import profile_range

            def trace(kernel: Any, *args: Any) -> tuple[Any, Any]:
                _, tr = run(kernel, *args, trace_only=True, keep_events=True)
                return profile_range(tr, schedule=True)

            self.profile = trace

    @staticmethod
    def _spec(shape: tuple[int, ...]) -> Any:
        import ml_dtypes

        from nki_kernels.emulator import TensorSpec

        return TensorSpec(shape, ml_dtypes.bfloat16)

    def _cached(
        self, key: tuple[Any, ...], compute: Callable[[], KernelCost], fallback: Callable[[], Any]
    ) -> Any:
        if key not in self._cache:
            try:
                self._cache[key] = compute()
            except Exception as e:  # noqa: BLE001 - any emulator failure -> labelled fallback
                fb = fallback()
                if fb is not None:
                    fb = replace(fb, source=f"{fb.source} (peer trace failed: {type(e).__name__}: {e})"[:200])
                self._cache[key] = fb
        return self._cache[key]

    def attention(self, lq: int, lk: int, heads: int, head_dim: int) -> KernelCost:
        """The peer's flash attention of ``lq`` queries over ``lk`` keys, ``heads`` local heads, bf16."""
        if min(lq, lk, heads, head_dim) < 1:
            raise ValueError(
                f"attention: shapes must be >= 1, got lq={lq} lk={lk} heads={heads} d={head_dim}"
            )

        def compute() -> KernelCost:
            from perf.e2e.peer_attention import padded_keys, peer_attention_kernel

            h = _heads_traced(heads, self.max_heads)
            kb = padded_keys(lk)
            assert self.profile is not None
            prof = self.profile(
                peer_attention_kernel,
                self._spec((h, head_dim, lq)),
                self._spec((h, head_dim, kb)),
                self._spec((h, kb, head_dim)),
                1.0 / math.sqrt(head_dim),
                lk,
            )
            src = "peer kernel traced" if h == heads else f"peer kernel traced at {h} heads x {heads // h}"
            return _profile_cost(*prof, 4 * lq * lk * heads * head_dim, src, heads // h)

        return self._cached(
            ("attn", lq, lk, heads, head_dim), compute, lambda: self.base.attention(lq, lk, heads, head_dim)
        )

    def cross_attention(self, lq: int, lk: int, heads: int, head_dim: int) -> KernelCost:
        """Cross-attention: ``base.attention`` (module docstring), or with ``cross_with_peer_kernel`` the
        peer-structure kernel of :meth:`attention`."""
        if self.cross_with_peer_kernel:
            return self.attention(lq, lk, heads, head_dim)
        c = self.base.attention(lq, lk, heads, head_dim)
        return replace(c, source=f"{c.source}; peer cross-attn priced by our kernel")

    def attention_layout(
        self, lq: int, lk: int, heads: int, head_dim: int, self_attention: bool = True
    ) -> KernelCost | None:
        """The D-major permutes before one attention call: q ``[lq, H, d]`` and k ``[Lk_buf, H, d]`` to
        ``[H, d, L]``, v to ``[H, Lk_buf, d]`` (``Lk_buf = padded_keys(lk)`` for self-attention, ``lk``
        for cross-attention). ``None`` if it cannot be traced (no fallback: the base provider has none)."""
        if min(lq, lk, heads, head_dim) < 1:
            raise ValueError(f"attention_layout: shapes must be >= 1, got {lq} {lk} {heads} {head_dim}")

        def compute() -> KernelCost:
            from perf.e2e.peer_attention import dmajor_layout_kernel, padded_keys

            h = _heads_traced(heads, self.max_heads)
            kb = padded_keys(lk) if self_attention else lk
            assert self.profile is not None
            prof = self.profile(
                dmajor_layout_kernel,
                self._spec((lq, h, head_dim)),
                self._spec((kb, h, head_dim)),
                self._spec((kb, h, head_dim)),
            )
            return _profile_cost(*prof, 0, "peer XLA permutes traced as DMA", heads // h)

        return self._cached(("layout", lq, lk, heads, head_dim, self_attention), compute, lambda: None)

    def rope(self, tokens: int, heads: int, head_dim: int) -> KernelCost:
        return self.base.rope(tokens, heads, head_dim)

    def kv_write(self, tokens: int, heads: int, head_dim: int) -> KernelCost:
        return self.base.kv_write(tokens, heads, head_dim)
