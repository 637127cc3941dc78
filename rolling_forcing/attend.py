"""Self-attention of one pass over the rolling KV cache: the arithmetic shared by every stream.

Used by the unsharded two-pass stream (:mod:`rolling_forcing.pipeline`) with all heads and by each rank
of the sharded stream (:mod:`sharding.pipeline`) with its head group: the functions only read the head
count from the tensors, so ``H`` below is whatever the cache buffers hold (all heads, or ``H/tp``).

A pass's cache keys (:class:`~rolling_forcing.schedule.KeyBlock`) come in two kinds: blocks roped in
the buffer at the pass's positions (read in place, ``ops.attention_segments``) and blocks that need a
roped copy (the sink; every block in ``"relative"`` mode). The copies and the pass's own keys are
attended in one ``ops.attention`` call; partials over the disjoint key sets are merged exactly with
their log-sum-exp.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from nki_kernels import ops
from rolling_forcing import schedule
from rolling_forcing.cache import LayerKVCache
from rolling_forcing.model import Grid
from rolling_forcing.schedule import KeyBlock, PassPlan

__all__ = [
    "PassTables",
    "attend_cache",
    "batched_update_attn",
    "copy_positions",
    "copy_tables",
    "merge_partials",
    "rope_cache_copies",
]


def merge_partials(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Exact combination of attention partials over disjoint key sets.

    Args:
        parts: non-empty list of ``(out [B, Lq, H, D], lse [B, Lq, H] fp32)``, each normalised over its
            own keys.

    Returns:
        ``sum_i exp(lse_i - logsumexp_i lse_i) * out_i`` ``[B, Lq, H, D]``, summed in fp32 in list order
        and cast to the first output's dtype; a single part is returned as is.
    """
    if not parts:
        raise ValueError("parts must hold at least one (out, lse) partial, got an empty list")
    if len(parts) == 1:
        return parts[0][0]
    lses = torch.stack([lse for _, lse in parts])  # [P, B, Lq, H]
    lse = torch.logsumexp(lses, dim=0)
    out = sum(torch.exp(lses[i] - lse)[..., None] * o.float() for i, (o, _) in enumerate(parts))
    assert isinstance(out, torch.Tensor)
    return out.to(parts[0][0].dtype)


def copy_positions(tokens_per_block: int, keys: Sequence[KeyBlock], grid: Grid) -> list[int]:
    """Time position of every frame of the roped copies of ``keys`` (block ``kb``: ``kb.position + i``)."""
    hw = grid[1] * grid[2]
    if tokens_per_block % hw:
        raise ValueError(
            f"grid {tuple(grid)}: Hp*Wp = {hw} does not divide the cache's tokens_per_block "
            f"{tokens_per_block}"
        )
    fpb = tokens_per_block // hw
    return [kb.position + i for kb in keys for i in range(fpb)]


def copy_tables(
    tokens_per_block: int,
    keys: Sequence[KeyBlock],
    grid: Grid,
    head_dim: int,
    *,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """RoPE ``(cos, sin)`` ``[copies * T, head_dim//2]`` of the roped copies among ``keys`` (None if none).

    ``keys`` are filtered to those not ``roped_in_cache`` (as :func:`attend_cache` does); the tables depend
    on the pass only, so a pass builds them once for all layers and passes them to :func:`attend_cache`.
    """
    copies = [kb for kb in keys if not kb.roped_in_cache]
    if not copies:
        return None
    pos = copy_positions(tokens_per_block, copies, grid)
    return ops.rope_tables(
        (len(pos), grid[1], grid[2]), head_dim, frame_positions=pos, dtype=dtype, device=device
    )


def rope_cache_copies(
    layer: LayerKVCache,
    keys: list[KeyBlock],
    grid: Grid,
    *,
    backend: str | None = None,
    tables: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather blocks ``keys`` from ``layer``'s buffers, the keys roped at each block's position.

    Args:
        layer: one layer's cache, buffers ``[B, S, H, D]`` (un-roped keys in the slots of ``keys``).
        keys: non-empty; block ``kb`` occupies ``layer.block(kb.slot)`` and is roped at time positions
            ``kb.position .. kb.position + fpb - 1``, ``fpb = layer.tokens_per_block / (Hp * Wp)``.
        grid: ``(F, Hp, Wp)`` of the pass (only ``Hp, Wp`` are used).
        backend: ``nki_kernels.ops`` backend of the RoPE.
        tables: optional ``(cos, sin)`` of exactly these blocks (:func:`copy_tables`, built once per pass);
            None builds them here.

    Returns:
        ``(k, v)`` ``[B, len(keys) * T, H, D]``: roped copies of the keys, and the values (copied).
    """
    if not keys:
        raise ValueError("keys must name at least one cached block, got none")
    hw = grid[1] * grid[2]
    if layer.tokens_per_block % hw:
        raise ValueError(
            f"grid {tuple(grid)}: Hp*Wp = {hw} does not divide the cache's tokens_per_block "
            f"{layer.tokens_per_block}"
        )
    fpb = layer.tokens_per_block // hw
    ks, vs = zip(*(layer.block(kb.slot) for kb in keys))
    k = torch.cat(ks, dim=1).contiguous()
    v = torch.cat(vs, dim=1).contiguous()
    if tables is None:
        pos = [kb.position + i for kb in keys for i in range(fpb)]
        tables = ops.rope_tables(
            (len(pos), grid[1], grid[2]),
            k.shape[3],
            frame_positions=pos,
            dtype=torch.float64,
            device=k.device,
        )
    _, kr = ops.rope3d_tables(k, k, tables[0], tables[1], backend=backend)
    return kr, v


def attend_cache(
    layer: LayerKVCache,
    qr: torch.Tensor,
    keys: tuple[KeyBlock, ...],
    own: tuple[torch.Tensor, torch.Tensor] | None,
    grid: Grid,
    *,
    backend: str | None = None,
    copy_tables: tuple[torch.Tensor, torch.Tensor] | None = None,
    own_start: int = 0,
) -> torch.Tensor:
    """Attention of roped queries over [roped copies] + [own keys] and [blocks read in place].

    Args:
        layer: one layer's cache, buffers ``[B, S, H, D]``.
        qr: roped queries ``[B, Lq, H, D]`` (same dtype as the cache).
        keys: the pass's cache keys (:attr:`~rolling_forcing.schedule.PassPlan.cache_keys`); those with
            ``roped_in_cache`` are read in place, the others roped as copies (:func:`rope_cache_copies`).
        own: buffers ``[B, L, H, D]`` (contiguous) holding the pass's own roped keys and values
            (denoise pass) as their tokens ``[own_start, L)``, or None.
        grid: ``(F, Hp, Wp)`` of the pass.
        backend: ``nki_kernels.ops`` backend of every call.
        copy_tables: the RoPE tables of the roped copies (:func:`copy_tables` of the same keys and grid),
            built once per pass; None builds them per call.
        own_start: the first own token of ``own``'s buffers, ``0 <= own_start < L`` (a forward whose
            leading tokens belong to another pass). With roped copies the own keys join them in the one
            ``ops.attention`` call (the concatenation copies them anyway); without, a non-zero
            ``own_start`` reads them in place (``ops.attention_segments``): a token slice of a ``B > 1``
            buffer is strided, and the ops read ``[B, L, H, D]`` row-major.

    Returns:
        ``[B, Lq, H, D]`` in ``qr``'s dtype: softmax attention over the union of the key sets.

    Raises ValueError when there is no key at all (no cache keys and no own keys), or for an
    ``own_start`` outside ``[0, L)``.
    """
    in_place = [kb for kb in keys if kb.roped_in_cache]
    copies = [kb for kb in keys if not kb.roped_in_cache]
    ks: list[torch.Tensor] = []
    vs: list[torch.Tensor] = []
    own_seg: tuple[int, int] | None = None  # own keys read in place: (start, length) of own's buffers
    if copies:
        ck, cv = rope_cache_copies(layer, copies, grid, backend=backend, tables=copy_tables)
        ks.append(ck)
        vs.append(cv)
    if own is None and own_start != 0:
        raise ValueError(f"own_start={own_start!r} applies to own keys, but own=None")
    if own is not None:
        n_own = own[0].shape[1]
        if isinstance(own_start, bool) or not isinstance(own_start, int) or not 0 <= own_start < n_own:
            raise ValueError(f"own_start must be an int in [0, L={n_own}) (own's tokens), got {own_start!r}")
        if own_start == 0:
            ks.append(own[0])
            vs.append(own[1])
        elif ks:  # strided views: the torch.cat below is their only copy
            ks.append(own[0][:, own_start:])
            vs.append(own[1][:, own_start:])
        else:
            own_seg = (own_start, n_own - own_start)
    if not ks and own_seg is None and not in_place:
        raise ValueError("attend_cache needs keys: no cache keys and own=None")
    more = bool(in_place)  # another partial follows the first
    parts: list[tuple[torch.Tensor, torch.Tensor]] = []
    if ks or own_seg is not None:
        if own_seg is not None:
            assert own is not None
            res = ops.attention_segments(qr, own[0], own[1], [own_seg], return_lse=more, backend=backend)
        else:
            k = ks[0] if len(ks) == 1 else torch.cat(ks, dim=1)
            v = vs[0] if len(vs) == 1 else torch.cat(vs, dim=1)
            res = ops.attention(qr, k, v, return_lse=more, backend=backend)
        if not more:
            assert isinstance(res, torch.Tensor)
            return res
        assert isinstance(res, tuple)
        parts.append(res)
    if in_place:
        segs = schedule.segments(in_place, layer.tokens_per_block)
        res2 = ops.attention_segments(qr, layer.k, layer.v, segs, return_lse=True, backend=backend)
        assert isinstance(res2, tuple)
        parts.append(res2)
    return merge_partials(parts)


class PassTables:
    """RoPE tables of one pass, built on first use and shared by every layer (the angles depend on the
    pass's positions and grid, never on the layer): the pass's own tokens from ``query_position`` and the
    roped copies of its cache keys. float64, so the reference backend is bitwise per-layer ``rope3d``."""

    def __init__(self, p: PassPlan, tokens_per_block: int) -> None:
        self.p, self.tokens_per_block = p, tokens_per_block
        self._built: dict[
            Grid, tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]
        ] = {}

    def get(
        self, grid: Grid, head_dim: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        if grid not in self._built:
            f64 = torch.float64
            cos, sin = ops.rope_tables(grid, head_dim, self.p.query_position, dtype=f64, device=device)
            ctab = copy_tables(
                self.tokens_per_block, self.p.cache_keys, grid, head_dim, dtype=f64, device=device
            )
            self._built[grid] = (cos, sin, ctab)
        return self._built[grid]


def batched_update_attn(
    layers: Sequence[LayerKVCache],
    upd: PassPlan,
    slot: int,
    store_roped: bool,
    den: PassPlan,
    *,
    backend: str | None = None,
) -> Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, Grid], torch.Tensor]:
    """Self-attention of one forward that batches a block's cache update with the next call's denoise.

    The forward holds ``2 * fpb`` frames: the previous block's clean x0 (update pass ``upd``, written to
    ``slot``; keys roped first when ``store_roped``) then one block to denoise (pass ``den``). Per layer:
    the update block's k/v are written first, so the denoise queries read them from the cache as their
    newest cached block, exactly as after a separate update forward; the update queries attend to
    ``upd.cache_keys`` (itself read back), the denoise queries to ``den.cache_keys`` + their own keys.
    When called with only the denoise queries (the last layer of ``forward_with(context_frames=fpb)``)
    the update queries are skipped. q ``[B, Lq, H, D]`` (Lq = 2T or T), k, v ``[B, 2T, H, D]``, all
    contiguous (the model's projections); returns ``[B, Lq, H, D]``, any batch size B.

    Layout: with B > 1 a token half of a ``[B, 2T, H, D]`` tensor is strided, and the ops read
    ``[B, L, H, D]`` row-major. So the 2T tokens are roped whole in one launch (each half at its pass's
    positions: the rows of a joint table), the denoise keys stay in the roped buffer
    (:func:`attend_cache` ``own_start=T``) and the update block goes to the cache through
    :meth:`LayerKVCache.write`, which stages the strided block (one [B, T] copy per tensor, the write's
    one launch); only each pass's queries are copied out, since a query set must be a whole tensor.
    """
    t = layers[0].tokens_per_block
    tab_u, tab_d = PassTables(upd, t), PassTables(den, t)
    joint: dict[Grid, tuple[torch.Tensor, torch.Tensor]] = {}  # [2T, D/2] rows: update, then denoise

    def attn(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: Grid) -> torch.Tensor:
        lc = layers[layer]
        gb: Grid = (grid[0] // 2, grid[1], grid[2])
        cos_u, sin_u, ctab_u = tab_u.get(gb, k.shape[3], k.device)
        cos_d, sin_d, ctab_d = tab_d.get(gb, k.shape[3], k.device)
        if gb not in joint:
            joint[gb] = (torch.cat([cos_u, cos_d]), torch.cat([sin_u, sin_d]))
        cos, sin = joint[gb]
        full = q.shape[1] == 2 * t
        qr, kr = ops.rope3d_tables(q if full else k, k, cos, sin, backend=backend)
        lc.write(slot, (kr if store_roped else k)[:, :t], v[:, :t], backend=backend)
        # the pass's queries as whole tensors: a copy out of the [B, 2T] buffer (nothing cheaper reads
        # one pass's queries; the last layer's q is the denoise tokens alone, roped on their own)
        qdr = qr[:, t:].contiguous() if full else ops.rope3d_tables(q, q, cos_d, sin_d, backend=backend)[0]
        out_d = attend_cache(
            lc, qdr, den.cache_keys, (kr, v), gb, backend=backend, copy_tables=ctab_d, own_start=t
        )
        if not full:
            return out_d
        out_u = attend_cache(
            lc, qr[:, :t].contiguous(), upd.cache_keys, None, gb, backend=backend, copy_tables=ctab_u
        )
        return torch.cat([out_u, out_d], dim=1)

    return attn
