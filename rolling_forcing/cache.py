"""The rolling KV cache: per layer a sink slot plus a ring of block slots, and the text k/v cache.

Layout per layer: ``k, v`` ``[B, buffer_slots * T, H, D]`` with T = tokens per block; slot ``i`` is
tokens ``[i*T, (i+1)*T)``. Slot 0 holds the sink (block 0, un-roped); block ``b >= 1`` lives in ring
slot ``rolling_forcing.schedule.slot_of(cfg, b)``. Writes go through ``nki_kernels.ops.kv_cache_write``;
reads are token segments handed to ``nki_kernels.ops.attention_segments`` (in place). The stream
position and the contents' meaning live in the pipeline's state, not here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from nki_kernels import ops
from rolling_forcing.config import ModelConfig, PipelineConfig
from rolling_forcing.fp8 import KV_FP8, kv_fp8_bytes_per_element, kv_fp8_roundtrip

if TYPE_CHECKING:
    from rolling_forcing.methods import StreamMethod


@dataclass
class LayerKVCache:
    """KV buffers of one layer ``[B, S, H, D]`` (S = ``buffer_slots * tokens_per_block``) and its text k/v."""

    k: torch.Tensor
    v: torch.Tensor
    tokens_per_block: int
    text_k: torch.Tensor | None = None
    text_v: torch.Tensor | None = None
    fp8: bool = False

    @property
    def num_slots(self) -> int:
        return self.k.shape[1] // self.tokens_per_block

    def write(self, slot: int, k: torch.Tensor, v: torch.Tensor, *, backend: str | None = None) -> None:
        """Write one block ``k, v`` ``[B, T, H, D]`` into ``slot`` in place (``ops.kv_cache_write``); an FP8
        cache (``fp8``) stores what its reads return (:func:`rolling_forcing.fp8.kv_fp8_roundtrip`)."""
        if k.shape[1] != self.tokens_per_block:
            raise ValueError(f"a block write needs T={self.tokens_per_block} tokens, got k {tuple(k.shape)}")
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot must be in [0, {self.num_slots}), got {slot}")
        if self.fp8:
            k, v = kv_fp8_roundtrip(k), kv_fp8_roundtrip(v)
        ops.kv_cache_write(self.k, self.v, k.contiguous(), v.contiguous(), slot, backend=backend)

    def block(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views ``(k, v)`` ``[B, T, H, D]`` of ``slot``."""
        t = self.tokens_per_block
        return self.k[:, slot * t : (slot + 1) * t], self.v[:, slot * t : (slot + 1) * t]


class RollingKVCache:
    """All layers' KV buffers of one stream (allocated once; fixed size for any stream length)."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        pipe_cfg: PipelineConfig | StreamMethod,
        batch: int,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
        num_heads: int | None = None,
        kv_dtype: str | None = None,
        block_tokens: tuple[int, int] | None = None,
        num_slots: int | None = None,
    ) -> None:
        """``num_heads`` defaults to the model's (a tensor-parallel shard passes its local head count);
        ``pipe_cfg`` (or a sequential ``StreamMethod``) gives the block and buffer sizes.  ``kv_dtype``:
        ``None`` = K/V in ``dtype``; ``"float8_e4m3"`` = the FP8 KV cache (off by default; see
        :mod:`rolling_forcing.fp8`).  ``block_tokens=(a, b)``: a sequence-parallel rank's share of the
        cache (``sharding.kv_shard``): every slot keeps only tokens ``[a, b)`` of its block
        (``0 <= a < b <= T``), so each layer is ``[B, buffer_slots * (b - a), H, D]``; None: whole
        blocks. ``num_slots``: block slots per layer (None: ``pipe_cfg.buffer_slots``; fewer only for a
        caller that maps the schedule's slots onto a shorter ring itself, ``sharding.kv_shard``'s
        ``"sp_compact"`` layout)."""
        if kv_dtype not in (None, KV_FP8):
            raise ValueError(f"kv_dtype must be None or {KV_FP8!r}, got {kv_dtype!r}")
        self.kv_dtype = kv_dtype
        if dtype is not None:
            dt = dtype
        elif isinstance(pipe_cfg, PipelineConfig):
            dt = pipe_cfg.torch_dtype
        else:
            raise ValueError("dtype is required when the sizes come from a StreamMethod")
        h = model_cfg.num_heads if num_heads is None else num_heads
        t_block = pipe_cfg.tokens_per_block(model_cfg)
        a, b = (0, t_block) if block_tokens is None else block_tokens
        if not (isinstance(a, int) and isinstance(b, int) and 0 <= a < b <= t_block):
            raise ValueError(
                f"block_tokens must be (a, b) with 0 <= a < b <= T={t_block}, got {block_tokens!r}"
            )
        self.block_tokens = (a, b)
        slots = pipe_cfg.buffer_slots if num_slots is None else num_slots
        if isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots <= pipe_cfg.buffer_slots:
            raise ValueError(f"num_slots must be an int in [1, {pipe_cfg.buffer_slots}], got {num_slots!r}")
        self.text_share: tuple[int, int] | None = None  # (index, count): this cache keeps a text share
        t = b - a
        shape = (batch, slots * t, h, model_cfg.head_dim)
        self.layers = [
            LayerKVCache(
                torch.zeros(shape, dtype=dt, device=device),
                torch.zeros(shape, dtype=dt, device=device),
                t,
                fp8=kv_dtype == KV_FP8,
            )
            for _ in range(model_cfg.num_layers)
        ]

    def set_text(self, text_kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Install per-layer cross-attention k/v (the text cache) computed for a prompt (with a
        :meth:`share_text` share set: only that share of the text tokens, copied)."""
        if len(text_kv) != len(self.layers):
            raise ValueError(f"text_kv has {len(text_kv)} layers, the cache has {len(self.layers)}")
        for layer, (k, v) in zip(self.layers, text_kv):
            if self.text_share is not None:
                a, b = text_share_range(k.shape[1], *self.text_share)
                k, v = k[:, a:b].clone(), v[:, a:b].clone()
            layer.text_k, layer.text_v = k, v

    def share_text(self, index: int, count: int) -> None:
        """Keep only share ``index`` of ``count`` of the text tokens (:func:`text_share_range`) of the text
        k/v installed now and by every later :meth:`set_text` (a sharded stream gathers the shares per
        layer). ``ValueError`` unless ``0 <= index < count``; RuntimeError if a share is set already."""
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"share_text: count must be a positive int, got {count!r}")
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < count:
            raise ValueError(f"share_text: index must be an int in [0, {count}), got {index!r}")
        if self.text_share is not None:
            raise RuntimeError(f"share_text: the cache keeps text share {self.text_share} already")
        whole = [(la.text_k, la.text_v) for la in self.layers]
        self.text_share = (index, count)
        if all(k is not None and v is not None for k, v in whole):
            self.set_text(whole)  # type: ignore[arg-type]

    def text_kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer text ``(k, v)``, each ``[B, text_len, H, D]``; RuntimeError before :meth:`set_text`."""
        out = []
        for i, layer in enumerate(self.layers):
            if layer.text_k is None or layer.text_v is None:
                raise RuntimeError(f"layer {i} has no text k/v: call set_text first")
            out.append((layer.text_k, layer.text_v))
        return out

    def reset(self) -> None:
        """Zero every buffer (a new stream)."""
        for layer in self.layers:
            layer.k.zero_()
            layer.v.zero_()
            layer.text_k = layer.text_v = None

    @property
    def nbytes(self) -> int:
        """Bytes of the self-attention KV buffers (all layers, k and v) as allocated here."""
        return sum(la.k.numel() * la.k.element_size() * 2 for la in self.layers)

    @property
    def device_nbytes(self) -> int:
        """Bytes the KV buffers take in the device layout: :attr:`nbytes`, or for the FP8 cache one byte per
        element plus an fp32 scale per token and head (``rolling_forcing.fp8.kv_fp8_bytes_per_element``)."""
        if self.kv_dtype != KV_FP8:
            return self.nbytes
        per = kv_fp8_bytes_per_element(self.layers[0].k.shape[-1])
        return round(sum(la.k.numel() * 2 * per for la in self.layers))


def text_share_range(tokens: int, index: int, count: int) -> tuple[int, int]:
    """Tokens ``[a, b)`` of share ``index`` of ``count`` near-equal shares of ``tokens`` text tokens (the
    first ``tokens % count`` shares hold one token more; a share may be empty when ``tokens < count``)."""
    base, extra = divmod(tokens, count)
    a = index * base + min(index, extra)
    return a, a + base + (index < extra)


__all__ = ["LayerKVCache", "RollingKVCache", "text_share_range"]
