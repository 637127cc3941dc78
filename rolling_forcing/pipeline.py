"""The Rolling Forcing stream: rolling window, staggered noise, attention sink, dual KV-cache pass.

Per window (plan from :func:`rolling_forcing.schedule.window_plan`):

1. **Denoise pass** over the window's blocks at their staggered timesteps. Per layer: rope q/k of the
   window, attend over [sink re-roped just before the working cache] + [working cache, read in place
   from the ring with ``ops.attention_segments``] + [the window's own keys]. The original's placeholder
   write of the start block is skipped: the update pass overwrites that slot before anything reads it
   (the test against the reference loop, which does write it, checks this).
2. **Re-noise** every block not at the last level to its next level with fresh noise.
3. **Cache-update pass** of the start block's x0 at t = 0: its clean k/v go into its slot
   (``ops.kv_cache_write``; the sink un-roped, other blocks roped in ``"absolute"`` mode) and it attends
   to the last ``key_budget_blocks`` cached blocks (the sink only while it is among them).
4. The start block, once at the last level, is final and yielded at once as a :class:`Chunk`.

By default (``merged=True``) the cache-update pass of window w-1 and the denoise pass of window w run as
ONE forward with static shapes (:mod:`rolling_forcing.merged`; equal to the two-pass stream, see
``docs/merged_forward.md``); ``merged=False`` runs the two passes separately as described above.

Partial attentions over disjoint key sets are merged exactly with their log-sum-exp
(:mod:`rolling_forcing.attend`, shared with the sharded stream).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from nki_kernels import ops
from rolling_forcing import schedule, sequential
from rolling_forcing.attend import PassTables, attend_cache, batched_update_attn
from rolling_forcing.cache import RollingKVCache
from rolling_forcing.config import POSITION_MODES, ModelConfig, PipelineConfig
from rolling_forcing.fp8 import KV_FP8
from rolling_forcing.merged import (
    CompileSpec,
    MergedForward,
    MergedIndex,
    MergedLayout,
    merged_step,
)
from rolling_forcing.methods import StreamMethod, get_method
from rolling_forcing.model import CausalWanModel, Grid, SelfAttnFn, add_noise, flow_to_x0
from rolling_forcing.schedule import PassPlan, WindowPlan
from rolling_forcing.sequential import StepPlan
from rolling_forcing.stream import Chunk, ForwardStats, NoiseSource, StreamState

Timing = PipelineConfig | StreamMethod
"""What the step functions read: ``frames_per_block``, ``timesteps`` (a PipelineConfig or a method)."""


def resolve_positions(pipe_cfg: PipelineConfig, positions: str | None) -> str:
    """The RoPE position mode of a stream: ``positions``, or ``pipe_cfg.positions`` when None.

    Raises ``ValueError`` naming ``positions`` if it is not one of ``POSITION_MODES``.
    """
    mode = pipe_cfg.positions if positions is None else positions
    if mode not in POSITION_MODES:
        raise ValueError(f"positions must be one of {POSITION_MODES}, got {mode!r}")
    return mode


def check_stream_args(
    model: CausalWanModel,
    pipe_cfg: PipelineConfig,
    text_embeds: torch.Tensor,
    num_blocks: int,
    positions: str,
) -> None:
    """Validate a stream's prompt ``[B, L<=text_len, text_dim]`` and length before any work is done.

    Raises ``ValueError`` for a prompt of the wrong shape, ``num_blocks < window_blocks`` and, in
    ``"absolute"`` mode, a stream longer than the RoPE table.
    """
    model._check_context(text_embeds)
    schedule.window_range(pipe_cfg, num_blocks, 0)  # validates num_blocks
    if positions == "absolute":
        schedule.check_positions(pipe_cfg, num_blocks, "absolute")


def check_method_stream(
    model: CausalWanModel,
    method: StreamMethod,
    pipe_cfg: PipelineConfig,
    text_embeds: torch.Tensor,
    num_blocks: int,
    positions: str,
) -> None:
    """Validate a stream of any method before any work (a sequential method's length, or
    :func:`check_stream_args` for Rolling Forcing)."""
    if method.sequential:
        model._check_context(text_embeds)
        sequential.check_length(method, num_blocks, positions)
    else:
        check_stream_args(model, pipe_cfg, text_embeds, num_blocks, positions)


def stream_plans(
    method: StreamMethod, pipe_cfg: PipelineConfig, num_blocks: int, positions: str
) -> Iterator[WindowPlan | StepPlan]:
    """The calls of a stream in order: Rolling Forcing windows (``pipe_cfg``), or a sequential method's
    steps; ``plan.index`` numbers them from 0."""
    if method.sequential:
        for i in range(sequential.num_steps(method, num_blocks)):
            yield sequential.step_plan(method, num_blocks, i, positions)
    else:
        for w in range(schedule.num_windows(pipe_cfg, num_blocks)):
            yield schedule.window_plan(pipe_cfg, num_blocks, w, positions)


def num_calls(method: StreamMethod, pipe_cfg: PipelineConfig, num_blocks: int) -> int:
    """Number of plans :func:`stream_plans` yields."""
    if method.sequential:
        return sequential.num_steps(method, num_blocks)
    return schedule.num_windows(pipe_cfg, num_blocks)


def window_input(
    pipe_cfg: Timing,
    plan: WindowPlan | StepPlan,
    noise: NoiseSource,
    noisy: dict[int, torch.Tensor],
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The window's latents ``[B, n*fpb, C, H, W]`` and per-frame timesteps ``[B, n*fpb]`` float32.

    The fresh block's input is drawn from ``noise``; every other block's current noisy latents are
    popped from ``noisy`` (block -> ``[B, fpb, C, H, W]``).
    """
    parts = []
    for b in plan.blocks:
        parts.append(noise.initial(b).to(device) if b == plan.fresh_block else noisy.pop(b))
    x_in = torch.cat(parts, dim=1)
    t_in = torch.tensor(schedule.frame_timesteps(pipe_cfg, plan.levels), dtype=torch.float32)
    return x_in, t_in[None].expand(x_in.shape[0], -1).contiguous()


def renoise_window(
    pipe_cfg: Timing,
    table: tuple[torch.Tensor, torch.Tensor],
    plan: WindowPlan | StepPlan,
    x0: torch.Tensor,
    noise: NoiseSource,
    noisy: dict[int, torch.Tensor],
) -> None:
    """Re-noise the window's x0 ``[B, n*fpb, C, H, W]`` to each block's next level, into ``noisy``.

    One fresh whole-window sample per re-noised block (the original's RNG order), of which the block's
    slice is used; ``table`` is ``pipe_cfg.scheduler_table()``.
    """
    fpb = pipe_cfg.frames_per_block
    for b, nxt in plan.renoise:
        eps = noise.renoise(x0.shape[1]).to(x0.device).unflatten(0, x0.shape[:2])
        i = b - plan.start_block
        blk = x0[:, i * fpb : (i + 1) * fpb]
        noisy[b] = add_noise(blk, eps[:, i * fpb : (i + 1) * fpb], pipe_cfg.timesteps[nxt], table)


class RollingForcingPipeline:
    """The streaming driver of every method (:mod:`rolling_forcing.methods`) on a ``CausalWanModel``.

    Rolling Forcing (the default) runs as described in the module docstring; a sequential method
    (Self-Forcing, CausVid, LongLive) runs its per-block calls (:mod:`rolling_forcing.sequential`) through
    the same two-pass loop, cache, attention and forward.

    Args:
        model: the DiT (weights in the dtype of ``pipe_cfg.dtype``).
        model_cfg, pipe_cfg: configurations (a sequential method reads only ``dtype`` and ``positions``
            from ``pipe_cfg``).
        method: a name of :data:`~rolling_forcing.methods.METHOD_NAMES` or a ``StreamMethod``; None =
            ``"rolling-forcing"`` with ``pipe_cfg``'s window, steps and sink.
        backend: ``nki_kernels.ops`` backend of every RoPE / attention / cache call (None: env/default).
        positions: ``"absolute"`` (the original; at most ``rope_table_size`` latent frames) or
            ``"relative"`` (positions re-based every pass; any length). None: ``pipe_cfg.positions``.
        merged: True: one static-shape forward per window (update of w-1 + denoise of w,
            :mod:`rolling_forcing.merged`); False: the two passes separately. None (default): merged when
            the backend implements ``ops.attention_block_table`` (the reference backend does; the kernel
            backends once an NKI kernel exists), else two-pass; ``self.merged`` tells which. Explicit
            ``merged=True`` on a backend without that kernel raises ``NotImplementedError``. Sequential
            methods run two-pass (None -> False; True raises ``NotImplementedError``).
        compile: merged mode only: ``torch.compile(fullgraph=True)`` the merged forward (True, or a
            dynamo backend name/callable); None: eager.
        kv_dtype: ``None`` (default): the KV cache in ``pipe_cfg.dtype``; ``"float8_e4m3"``: the FP8 KV
            cache (K/V quantised per token and head at the write, :mod:`rolling_forcing.fp8`; an option
            that is off by default, see ``docs/kernels/linear_fp8.md`` for its gate).
    """

    def __init__(
        self,
        model: CausalWanModel,
        model_cfg: ModelConfig,
        pipe_cfg: PipelineConfig,
        *,
        backend: str | None = None,
        positions: str | None = None,
        merged: bool | None = None,
        compile: CompileSpec = None,
        method: str | StreamMethod | None = None,
        static: bool = False,
        kv_dtype: str | None = None,
    ) -> None:
        if kv_dtype not in (None, KV_FP8):
            raise ValueError(f"kv_dtype must be None or {KV_FP8!r}, got {kv_dtype!r}")
        self.kv_dtype = kv_dtype
        kv8 = kv_dtype == KV_FP8
        meth = get_method("rolling-forcing" if method is None else method)
        mode = resolve_positions(pipe_cfg, positions)
        if merged is not None and not isinstance(merged, bool):
            raise TypeError(f"merged must be a bool or None, got {type(merged).__name__}")
        if (
            not meth.sequential
            and method is not None
            and meth.pipeline_config(pipe_cfg.dtype, pipe_cfg.positions) != pipe_cfg
        ):
            raise ValueError(f"method={meth.name!r} does not match pipe_cfg {pipe_cfg}")
        self.method = meth
        self._timing: Timing = meth if meth.sequential else pipe_cfg
        supported = ops.has_kernel("attention_block_table", backend) and not meth.sequential
        if merged and not supported and not meth.sequential:
            raise NotImplementedError(
                f"merged=True needs ops.attention_block_table, which backend={backend!r} does not implement "
                "yet (no NKI kernel); use merged=False (two passes) or backend='reference'"
            )
        self.merged = supported if merged is None else merged
        if static and not meth.sequential:
            raise ValueError(
                "static=True is for sequential methods (Rolling Forcing's merged forward is static)"
            )
        if static and merged is False:
            raise ValueError("static=True batches the cache updates: it needs merged=True or None")
        self.static = bool(static)
        self.merged = self.merged or self.static
        if compile not in (None, False) and not self.merged:
            raise ValueError("compile= applies to the merged forward only; it needs merged=True")
        if compile not in (None, False) and meth.sequential and not self.static:
            raise ValueError(
                f"compile= applies to Rolling Forcing's merged forward only, not method={meth.name!r}"
            )
        self.model, self.model_cfg, self.pipe_cfg = model, model_cfg, pipe_cfg
        self.backend = backend
        self.positions = mode
        self._table = self._timing.scheduler_table()
        self._pending_prompt: tuple[torch.Tensor, bool] | None = None
        self.state: StreamState | None = None
        self.stats = ForwardStats()
        self._layout = MergedLayout.from_configs(model_cfg, pipe_cfg, mode)
        if self.static:
            lay = sequential.static_layout(meth, meth.tokens_per_block(model_cfg), mode)
            self._merged_fwd: MergedForward | None = MergedForward(model, lay, backend, compile, kv8)
        elif self.merged and not meth.sequential:
            self._merged_fwd = MergedForward(model, self._layout, backend, compile, kv8)
        else:
            self._merged_fwd = None

    # ---- public API ----------------------------------------------------------------------------
    def set_prompt(self, text_embeds: torch.Tensor, recache: bool = False) -> None:
        """Switch the prompt of the running stream; takes effect at its next window.

        A new :meth:`stream` call starts from the ``text_embeds`` given to it and drops a switch that is
        still pending (the stream it was meant for has no next window).

        The text k/v cache is recomputed for ``text_embeds`` ``[B, L<=text_len, text_dim]``. With
        ``recache=True`` the clean blocks still in the KV cache are re-encoded under the new prompt:
        Rolling Forcing oldest first, each attending to the cached blocks before it (this project's
        adaptation of LongLive's KV re-cache); LongLive as the original (one pass, sink protected). A
        sequential method takes the switch at its next block. ``recache=True`` with a method whose
        original has no re-cache (Self-Forcing, CausVid) raises ``ValueError``.
        """
        if recache and self.method.recache == "none":
            raise ValueError(
                f"recache=True: method {self.method.name!r} has no KV re-cache in its original (LongLive's "
                "re-cache is method='longlive'); switch with recache=False"
            )
        self.model._check_context(text_embeds)
        self._pending_prompt = (text_embeds, bool(recache))

    @torch.no_grad()
    def stream(
        self,
        text_embeds: torch.Tensor,
        num_blocks: int,
        *,
        generator: torch.Generator | None = None,
        noise: torch.Tensor | NoiseSource | None = None,
    ) -> Iterator[Chunk]:
        """Generate ``num_blocks`` blocks, yielding each :class:`Chunk` as soon as it is final.

        Args:
            text_embeds: ``[B, L<=text_len, text_dim]`` prompt embeddings.
            num_blocks: blocks to generate (Rolling Forcing: >= ``window_blocks``; in ``"absolute"`` mode
                at most ``StreamMethod.max_blocks``: the RoPE table, or Self-Forcing's and CausVid's
                21-frame cache).
            generator: RNG of all noise draws (global RNG when None).
            noise: initial noise ``[B, num_blocks*fpb, C, H, W]`` (the original's ``noise`` argument), or a
                :class:`NoiseSource`; None draws it from ``generator`` in the original order.
        """
        cfg, mcfg = self.pipe_cfg, self.model_cfg
        check_method_stream(self.model, self.method, cfg, text_embeds, num_blocks, self.positions)
        fpb = self._timing.frames_per_block
        bsz = text_embeds.shape[0]
        dtype = cfg.torch_dtype
        device = self.model.patch_embedding.weight.device
        if isinstance(noise, NoiseSource):
            src = noise
        else:
            src = NoiseSource(
                bsz, mcfg.latent_frame_shape(), fpb, num_blocks, dtype,
                generator=generator, initial_noise=noise,
            )  # fmt: skip
        cache = RollingKVCache(mcfg, self._timing, bsz, device=device, dtype=dtype, kv_dtype=self.kv_dtype)
        cache.set_text(self.model.text_kv(text_embeds.to(dtype)))
        self._pending_prompt = None
        st = StreamState(num_blocks, cache, src)
        self.state = st
        self.stats = ForwardStats()
        if self.merged and not self.method.sequential:
            yield from self._merged_windows(st)
        else:
            yield from self._run_steps(st, stream_plans(self.method, cfg, num_blocks, self.positions))
        self.state = None

    # ---- internals -----------------------------------------------------------------------------
    def _window_input(
        self, st: StreamState, plan: WindowPlan | StepPlan
    ) -> tuple[torch.Tensor, torch.Tensor]:
        device = self.model.patch_embedding.weight.device
        return window_input(self._timing, plan, st.noise, st.noisy, device)

    def _renoise(self, st: StreamState, plan: WindowPlan | StepPlan, x0: torch.Tensor) -> None:
        renoise_window(self._timing, self._table, plan, x0, st.noise, st.noisy)

    def _merged_windows(self, st: StreamState) -> Iterator[Chunk]:
        """One merged forward per window: update of the previous window + denoise of this one."""
        assert self._merged_fwd is not None
        cfg, lay = self.pipe_cfg, self._layout
        fpb = cfg.frames_per_block
        cache = st.cache
        ks = [la.k for la in cache.layers]
        vs = [la.v for la in cache.layers]
        device = ks[0].device
        pending: tuple[WindowPlan, torch.Tensor] | None = None  # (plan, clean x0 of its start block)
        for w in range(schedule.num_windows(cfg, st.num_blocks)):
            st.window = w
            if self._pending_prompt is not None:
                if pending is not None:  # the pending update belongs to the old prompt: run it alone
                    self._update(st, pending[0].update, pending[0], pending[1], cache.text_kv())
                    pending = None
                self._apply_prompt(st, w)
            plan = schedule.window_plan(cfg, st.num_blocks, w, self.positions)
            x_win, t_win = self._window_input(st, plan)
            bsz, nf = x_win.shape[:2]
            step = merged_step(
                cfg, lay, st.num_blocks, w, self.positions, pending[0].index if pending is not None else None
            )
            upd = pending[1] if pending is not None else x_win.new_zeros((bsz, fpb, *x_win.shape[2:]))
            pad = x_win.new_zeros((bsz, lay.frames - fpb - nf, *x_win.shape[2:]))
            x = torch.cat([upd, x_win, pad], dim=1)
            t = torch.zeros(bsz, lay.frames, dtype=torch.float32)
            t[:, :fpb] = float(cfg.context_noise)
            t[:, fpb : fpb + nf] = t_win
            idx = MergedIndex.from_step(step, lay, device)
            self.stats.log("merged", x, t, *idx.tensors())
            flow = self._merged_fwd(x, t, cache.text_kv(), ks, vs, idx)
            x0 = flow_to_x0(flow[:, :nf], x_win, t_win, self._table)  # flow: the padded window only
            self._renoise(st, plan, x0)
            if pending is not None:
                self._record_clean(st, pending[0].start_block, pending[1])
            clean = x0[:, :fpb].contiguous()
            pending = (plan, clean)  # the last window's update is never read: it is not run
            if plan.finished_block is not None:
                yield Chunk(plan.start_block, clean, True, plan.start_block == st.num_blocks - 1, w)

    def _run_steps(self, st: StreamState, plans: Iterator[WindowPlan | StepPlan]) -> Iterator[Chunk]:
        """The originals' order per call: denoise forward, re-noise, cache-update forward (if any).

        Merged sequential mode (``merged=True`` with a sequential method): a block's cache update is
        held back and batched with the next block's first denoise call in one forward
        (:func:`rolling_forcing.attend.batched_update_attn`); before a prompt switch it runs alone, and the
        last block's update (never read) is not run."""
        cache = st.cache
        fpb = self._timing.frames_per_block
        batch_updates = self.merged and self.method.sequential
        pending: tuple[StepPlan | WindowPlan, PassPlan, torch.Tensor] | None = None
        for plan in plans:
            w = plan.index
            st.window = w
            if self._pending_prompt is not None and plan.prompt_boundary:
                if pending is not None:  # the held-back update belongs to the old prompt
                    self._update(st, pending[1], pending[0], pending[2], cache.text_kv())
                    pending = None
                self._apply_prompt(st, plan.start_block)
            x_in, t_in = self._window_input(st, plan)
            if self.static:
                flow = self._static_forward(st, pending, plan, x_in, t_in)
                pending = None
            elif pending is not None:
                flow = self._batched_forward(st, pending, plan, x_in, t_in)
                pending = None
            else:
                self.stats.log("denoise", x_in, t_in)
                flow = self.model.forward_with(
                    x_in, t_in, cache.text_kv(), self._denoise_attn(plan), backend=self.backend
                )
            x0 = flow_to_x0(flow, x_in, t_in, self._table)
            self._renoise(st, plan, x0)
            clean = x0[:, :fpb].contiguous()
            if plan.update is not None and batch_updates:
                pending = (plan, plan.update, clean)
            elif plan.update is not None:
                self._update(st, plan.update, plan, clean, cache.text_kv())
            if plan.finished_block is not None:
                yield Chunk(plan.start_block, clean, True, plan.start_block == st.num_blocks - 1, w)

    def _static_forward(
        self,
        st: StreamState,
        pending: tuple[StepPlan | WindowPlan, PassPlan, torch.Tensor] | None,
        plan: StepPlan | WindowPlan,
        x_in: torch.Tensor,
        t_in: torch.Tensor,
    ) -> torch.Tensor:
        """``static=True``: one :func:`rolling_forcing.merged.merged_forward` (static shapes, one graph
        per stream) of the held-back cache update (masked when none) + this call's block to denoise."""
        assert self._merged_fwd is not None
        lay = self._merged_fwd.layout
        upd_step = pending[0].index if pending is not None else None
        step = sequential.static_step(self.method, lay, st.num_blocks, plan.index, self.positions, upd_step)
        upd = pending[2] if pending is not None else torch.zeros_like(x_in)
        x = torch.cat([upd, x_in], dim=1)
        t = torch.cat([torch.full_like(t_in, float(self._timing.context_noise)), t_in], dim=1)
        idx = MergedIndex.from_step(step, lay, x.device)
        self.stats.log("static", x, t, *idx.tensors())
        ks, vs = [la.k for la in st.cache.layers], [la.v for la in st.cache.layers]
        flow = self._merged_fwd(x, t, st.cache.text_kv(), ks, vs, idx)
        if pending is not None:
            self._record_clean(st, pending[0].start_block, pending[2])
        return flow

    def _batched_forward(
        self,
        st: StreamState,
        prev: tuple[StepPlan | WindowPlan, PassPlan, torch.Tensor],
        plan: StepPlan | WindowPlan,
        x_in: torch.Tensor,
        t_in: torch.Tensor,
    ) -> torch.Tensor:
        """One forward: the held-back cache update ``prev = (plan, update pass, clean x0)`` at t =
        context_noise + ``plan``'s denoise; returns the denoise frames' flow."""
        pplan, upd, clean = prev
        fpb = clean.shape[1]
        x = torch.cat([clean, x_in], dim=1)
        t0 = torch.full((clean.shape[0], fpb), float(self._timing.context_noise), dtype=torch.float32)
        t = torch.cat([t0, t_in], dim=1)
        self.stats.log("batched", x, t)
        attn = batched_update_attn(
            st.cache.layers, upd, pplan.write_slot, pplan.store_roped, plan.denoise, backend=self.backend
        )
        flow = self.model.forward_with(
            x, t, st.cache.text_kv(), attn, backend=self.backend, context_frames=fpb
        )
        self._record_clean(st, pplan.start_block, clean)
        return flow

    def _update(
        self,
        st: StreamState,
        upd: PassPlan,
        plan: WindowPlan | StepPlan,
        clean: torch.Tensor,
        text_kv: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> None:
        cfg = self._timing
        bsz = clean.shape[0]
        t0 = torch.full((bsz, cfg.frames_per_block), float(cfg.context_noise), dtype=torch.float32)
        attn = self._update_attn(upd, plan.write_slot, plan.store_roped)
        self.stats.log("update", clean, t0)
        # only the k/v writes matter: the last layer stops at them (context_frames = all frames)
        self.model.forward_with(clean, t0, text_kv, attn, backend=self.backend, context_frames=clean.shape[1])
        self._record_clean(st, plan.start_block, clean)

    def _record_clean(self, st: StreamState, s: int, clean: torch.Tensor) -> None:
        """Remember the x0 of block s, now cached (for re-caching at a prompt switch)."""
        cfg = self.pipe_cfg
        st.clean[s] = clean
        sink = set(range(cfg.sink_blocks))
        keep = sink | set(range(max(cfg.sink_blocks, s - cfg.ring_slots + 1), s + 1))
        for b in [b for b in st.clean if b not in keep]:
            del st.clean[b]

    def _apply_prompt(self, st: StreamState, block: int) -> None:
        """Install the pending prompt before the call of ``block`` (re-caching if asked)."""
        assert self._pending_prompt is not None
        emb, recache = self._pending_prompt
        self._pending_prompt = None
        if emb.shape[0] != st.cache.layers[0].k.shape[0]:
            raise ValueError(
                f"new prompt batch {emb.shape[0]} != stream batch {st.cache.layers[0].k.shape[0]}"
            )
        st.cache.set_text(self.model.text_kv(emb.to(self.pipe_cfg.torch_dtype)))
        if not recache:
            return
        if self.method.sequential:
            self._recache_window(st, block)
            return
        cfg = self.pipe_cfg
        present = sorted(st.clean)
        oldest_ring = min((b for b in present if b >= cfg.sink_blocks), default=0)
        for b in present:
            w_b = b + cfg.window_blocks - 1  # the window whose update pass cached block b
            plan = schedule.window_plan(cfg, st.num_blocks, w_b, self.positions)
            keys = tuple(
                k for k in plan.update.cache_keys if k.block < cfg.sink_blocks or k.block >= oldest_ring
            )
            upd = PassPlan(plan.update.query_blocks, plan.update.query_position, keys, False)
            attn = self._update_attn(upd, plan.write_slot, plan.store_roped)
            t0 = torch.zeros(st.clean[b].shape[:2], dtype=torch.float32)
            self.model.forward_with(
                st.clean[b], t0, st.cache.text_kv(), attn, backend=self.backend, context_frames=t0.shape[1]
            )

    def _recache_window(self, st: StreamState, block: int) -> None:
        """LongLive's re-cache before ``block``: one clean pass under the new prompt over the last blocks
        (:func:`rolling_forcing.sequential.recache_plan`), writing their k/v (the sink protected)."""
        rp = sequential.recache_plan(self.method, block, self.positions)
        if rp is None:
            return
        cache = st.cache
        x = torch.cat([st.clean[b] for b in rp.blocks], dim=1)
        t0 = torch.full(x.shape[:2], float(self.method.context_noise), dtype=torch.float32)
        tpb = cache.layers[0].tokens_per_block
        tables = PassTables(rp.pass_, tpb)

        def attn(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: Grid) -> torch.Tensor:
            lc = cache.layers[layer]
            cos, sin, ctab = tables.get(grid, k.shape[3], k.device)
            qr, kr = ops.rope3d_tables(k if q.shape[1] == 0 else q, k, cos, sin, backend=self.backend)
            store = kr if rp.store_roped else k
            for i, slot in enumerate(rp.slots):
                sl = slice(i * tpb, (i + 1) * tpb)
                lc.write(slot, store[:, sl], v[:, sl], backend=self.backend)
            if q.shape[1] == 0:  # last layer: only the writes are needed
                return q
            return attend_cache(
                lc, qr, rp.pass_.cache_keys, (kr, v), grid, backend=self.backend, copy_tables=ctab
            )

        self.stats.log("recache", x, t0)
        self.model.forward_with(x, t0, cache.text_kv(), attn, backend=self.backend, context_frames=x.shape[1])

    def _denoise_attn(self, plan: WindowPlan | StepPlan) -> SelfAttnFn:
        cache = self.state.cache if self.state is not None else None
        assert cache is not None
        p = plan.denoise
        tables = PassTables(p, cache.layers[0].tokens_per_block)

        def attn(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: Grid) -> torch.Tensor:
            cos, sin, ctab = tables.get(grid, q.shape[3], q.device)
            qr, kr = ops.rope3d_tables(q, k, cos, sin, backend=self.backend)
            return attend_cache(
                cache.layers[layer], qr, p.cache_keys, (kr, v), grid, backend=self.backend, copy_tables=ctab
            )

        return attn

    def _update_attn(self, p: PassPlan, slot: int, store_roped: bool) -> SelfAttnFn:
        cache = self.state.cache if self.state is not None else None
        assert cache is not None
        tables = PassTables(p, cache.layers[0].tokens_per_block)

        def attn(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: Grid) -> torch.Tensor:
            lc = cache.layers[layer]
            cos, sin, ctab = tables.get(grid, k.shape[3], k.device)
            if q.shape[1] == 0:  # last layer (forward_with context_frames): only the write is needed
                if store_roped:
                    _, k = ops.rope3d_tables(k, k, cos, sin, backend=self.backend)
                lc.write(slot, k, v, backend=self.backend)
                return q
            qr, kr = ops.rope3d_tables(q, k, cos, sin, backend=self.backend)
            lc.write(slot, kr if store_roped else k, v, backend=self.backend)
            return attend_cache(lc, qr, p.cache_keys, None, grid, backend=self.backend, copy_tables=ctab)

        return attn


__all__ = [
    "Chunk",
    "ForwardStats",
    "NoiseSource",
    "RollingForcingPipeline",
    "StreamState",
    "check_method_stream",
    "check_stream_args",
    "num_calls",
    "renoise_window",
    "resolve_positions",
    "stream_plans",
    "window_input",
]
