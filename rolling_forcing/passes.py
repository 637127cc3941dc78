"""The unsharded stream's forwards (:class:`LocalPasses`, a :class:`rolling_forcing.driver.StreamPasses`):
``CausalWanModel.forward_with`` with self-attention closures over the stream's cache, or the merged
forward (:mod:`rolling_forcing.merged`). Every closure gets the cache from the :class:`StreamState` the
driver passes in; nothing is kept between streams but the forward counters.

Self-attention per pass (RoPE tables built once per pass and shared by the layers,
:class:`~rolling_forcing.attend.PassTables`):

* **denoise**: rope q/k of the window, attend over [the cache keys of the pass] + [the window's own keys]
  (:func:`~rolling_forcing.attend.attend_cache`; ring blocks read in place).
* **update** (a cache update or a Rolling Forcing re-cache pass): rope, write the block's k/v into its slot
  (roped keys in ``"absolute"`` mode, except the sink), attend over the cache keys (itself read back). The
  last layer only writes (``forward_with(context_frames=F)``).
* **batched** (sequential methods, ``merged=True``): :func:`~rolling_forcing.attend.batched_update_attn`.
* **merged / static**: one :class:`~rolling_forcing.merged.MergedForward` with index tensors.
* **recache** (LongLive): the written blocks attend to the protected sink + themselves.
"""

from __future__ import annotations

import torch

from nki_kernels import ops
from rolling_forcing.attend import PassTables, attend_cache, batched_update_attn
from rolling_forcing.cache import RollingKVCache
from rolling_forcing.driver import DriverSpec, HeldUpdate, Plan, UpdateMode, merged_call_step
from rolling_forcing.merged import MergedForward, MergedIndex
from rolling_forcing.model import CausalWanModel, Grid, SelfAttnFn
from rolling_forcing.schedule import PassPlan, WritePass
from rolling_forcing.sequential import RecachePlan
from rolling_forcing.stream import ForwardStats, StreamState


class LocalPasses:
    """The forwards of one unsharded stream (see the module docstring).

    Args:
        model: the DiT.
        spec: the stream (``spec.mode`` picks the merged forward: ``MERGED`` needs ``merged_fwd``).
        backend: ``nki_kernels.ops`` backend of every RoPE / attention / cache call.
        merged_fwd: the merged forward (``UpdateMode.MERGED``), else None.
    """

    def __init__(
        self,
        model: CausalWanModel,
        spec: DriverSpec,
        backend: str | None,
        merged_fwd: MergedForward | None = None,
    ) -> None:
        if (spec.mode is UpdateMode.MERGED) != (merged_fwd is not None):
            raise ValueError("merged_fwd is required for UpdateMode.MERGED and only for it")
        self.model, self.spec, self.backend, self.merged_fwd = model, spec, backend, merged_fwd
        self.stats = ForwardStats()  # measured: forwards of the current stream by kind and signature

    # ---- the passes ----------------------------------------------------------------------------------
    def denoise_pass(self, st: StreamState, plan: Plan, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        self.stats.log("denoise", x, t)
        attn = denoise_attn(st.cache, plan.denoise, self.backend)
        return self.model.forward_with(x, t, st.cache.text_kv(), attn, backend=self.backend)

    def merged_pass(
        self, st: StreamState, plan: Plan, held: HeldUpdate | None, x: torch.Tensor, t: torch.Tensor
    ) -> torch.Tensor:
        cache = st.cache
        fpb = self.spec.timing.frames_per_block
        if self.merged_fwd is None:  # BATCHED: the held update + one block to denoise, eager
            assert held is not None
            self.stats.log("batched", x, t)
            w = held.write
            attn = batched_update_attn(
                cache.layers, w.pass_, w.slot, w.store_roped, plan.denoise, backend=self.backend
            )
            return self.model.forward_with(
                x, t, cache.text_kv(), attn, backend=self.backend, context_frames=fpb
            )
        spec = self.spec
        step = merged_call_step(
            spec.method, spec.pipe_cfg, self.merged_fwd.layout, st.num_blocks, plan.index, spec.positions,
            None if held is None else held.plan.index,
        )  # fmt: skip
        ks = [la.k for la in cache.layers]
        vs = [la.v for la in cache.layers]
        idx = MergedIndex.from_step(step, self.merged_fwd.layout, ks[0].device)
        self.stats.log("static" if spec.method.sequential else "merged", x, t, *idx.tensors())
        return self.merged_fwd(x, t, cache.text_kv(), ks, vs, idx)

    def update_pass(
        self, st: StreamState, write: WritePass, x: torch.Tensor, t: torch.Tensor, kind: str
    ) -> None:
        self.stats.log(kind, x, t)
        attn = update_attn(st.cache, write.pass_, write.slot, write.store_roped, self.backend)
        # only the k/v writes matter: the last layer stops at them (context_frames = all frames)
        self.model.forward_with(
            x, t, st.cache.text_kv(), attn, backend=self.backend, context_frames=x.shape[1]
        )

    def recache_pass(self, st: StreamState, rp: RecachePlan, x: torch.Tensor, t: torch.Tensor) -> None:
        self.stats.log("recache", x, t)
        attn = recache_attn(st.cache, rp, self.backend)
        self.model.forward_with(
            x, t, st.cache.text_kv(), attn, backend=self.backend, context_frames=x.shape[1]
        )


# ---- self-attention closures (the cache passed explicitly) ----------------------------------------------
def denoise_attn(cache: RollingKVCache, p: PassPlan, backend: str | None) -> SelfAttnFn:
    """Self-attention of a denoise pass ``p``: [cache keys of ``p``] + the window's own keys."""
    tables = PassTables(p, cache.layers[0].tokens_per_block)

    def attn(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: Grid) -> torch.Tensor:
        cos, sin, ctab = tables.get(grid, q.shape[3], q.device)
        qr, kr = ops.rope3d_tables(q, k, cos, sin, backend=backend)
        return attend_cache(
            cache.layers[layer], qr, p.cache_keys, (kr, v), grid, backend=backend, copy_tables=ctab
        )

    return attn


def update_attn(
    cache: RollingKVCache, p: PassPlan, slot: int, store_roped: bool, backend: str | None
) -> SelfAttnFn:
    """Self-attention of a cache-writing pass ``p`` of one block: write its k/v into ``slot`` (roped first
    when ``store_roped``), attend over ``p.cache_keys`` (the block read back); the last layer only writes."""
    tables = PassTables(p, cache.layers[0].tokens_per_block)

    def attn(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: Grid) -> torch.Tensor:
        lc = cache.layers[layer]
        cos, sin, ctab = tables.get(grid, k.shape[3], k.device)
        if q.shape[1] == 0:  # last layer (forward_with context_frames): only the write is needed
            if store_roped:
                _, k = ops.rope3d_tables(k, k, cos, sin, backend=backend)
            lc.write(slot, k, v, backend=backend)
            return q
        qr, kr = ops.rope3d_tables(q, k, cos, sin, backend=backend)
        lc.write(slot, kr if store_roped else k, v, backend=backend)
        return attend_cache(lc, qr, p.cache_keys, None, grid, backend=backend, copy_tables=ctab)

    return attn


def recache_attn(cache: RollingKVCache, rp: RecachePlan, backend: str | None) -> SelfAttnFn:
    """Self-attention of LongLive's re-cache pass ``rp``: write the blocks' k/v into ``rp.slots``, attend
    over ``rp.pass_.cache_keys`` (the protected sink) + their own keys; the last layer only writes."""
    tpb = cache.layers[0].tokens_per_block
    tables = PassTables(rp.pass_, tpb)

    def attn(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: Grid) -> torch.Tensor:
        lc = cache.layers[layer]
        cos, sin, ctab = tables.get(grid, k.shape[3], k.device)
        qr, kr = ops.rope3d_tables(k if q.shape[1] == 0 else q, k, cos, sin, backend=backend)
        store = kr if rp.store_roped else k
        for i, slot in enumerate(rp.slots):
            sl = slice(i * tpb, (i + 1) * tpb)
            lc.write(slot, store[:, sl], v[:, sl], backend=backend)
        if q.shape[1] == 0:  # last layer: only the writes are needed
            return q
        return attend_cache(lc, qr, rp.pass_.cache_keys, (kr, v), grid, backend=backend, copy_tables=ctab)

    return attn


__all__ = ["LocalPasses", "denoise_attn", "recache_attn", "update_attn"]
