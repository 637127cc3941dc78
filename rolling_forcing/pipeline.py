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

The loop itself (windows, prompt switches and re-cache passes, the held merged update, the clean blocks
kept for a re-cache) is :class:`rolling_forcing.driver.StreamDriver`, the one driver of the unsharded
and the sharded stream; this class is the unsharded front: it validates the options, owns the stream's
state and supplies the forwards (:class:`rolling_forcing.passes.LocalPasses`).
"""

from __future__ import annotations

from collections.abc import Generator

import torch

from rolling_forcing import sequential
from rolling_forcing.config import ModelConfig, PipelineConfig, check_guidance, check_sigma_min
from rolling_forcing.driver import (
    DriverSpec,
    Plan,
    StreamDriver,
    Switch,
    Timing,
    UpdateMode,
    check_method_stream,
    check_stream_args,
    num_calls,
    renoise_window,
    resolve_positions,
    resolve_update_mode,
    stream_plans,
    window_input,
)
from rolling_forcing.fp8 import KV_FP8
from rolling_forcing.guidance import GuidedNoise, guided_embeds
from rolling_forcing.merged import CompileSpec, MergedForward, MergedLayout
from rolling_forcing.methods import StreamMethod, get_method
from rolling_forcing.model import CausalWanModel
from rolling_forcing.passes import LocalPasses
from rolling_forcing.stream import Chunk, ForwardStats, NoiseSource, ShiftedNoise, StreamState


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
            the backend implements ``ops.attention_block_table`` (``ops.has_kernel``), else two-pass;
            ``self.merged`` tells which. Explicit ``merged=True`` on a backend without it raises
            ``NotImplementedError``. Sequential methods run two-pass by default (None -> False); True
            batches each block's cache update with the next block's first denoise call. The rule is
            :func:`rolling_forcing.driver.resolve_update_mode`, shared with the sharded stream.
        compile: merged mode only: ``torch.compile(fullgraph=True)`` the merged forward (True, or a
            dynamo backend name/callable); None: eager.
        static: sequential methods only: every call is one static-shape merged forward of [the held-back
            cache update (masked when none), the block to denoise] (needs ``merged`` True or None).
        kv_dtype: ``None`` (default): the KV cache in ``pipe_cfg.dtype``; ``"float8_e4m3"``: the FP8 KV
            cache (K/V quantised per token and head at the write, :mod:`rolling_forcing.fp8`; an option
            that is off by default, see ``docs/kernels/linear_fp8.md`` for its gate).
        attn_fp8: the self-attention's P.V in FP8 (``ops.attention_block_table(fp8=True)``, an option off by
            default; docs/kernels/attention_fp8.md). The merged forward only (ValueError for a
            two-pass stream); bf16 only (the op's TypeError); on the kernel backends windows of >= 2,048
            key positions (the op's ValueError).
        guidance_scale: classifier-free guidance (:mod:`rolling_forcing.guidance`), a finite number >= 1;
            None (default): ``model_cfg.guidance_scale`` (1 for the distilled originals, the demo preset's
            :data:`~rolling_forcing.config.DEMO_GUIDANCE`). Above 1 every forward runs the batch twice
            (prompt, then negative prompt: ``stream(negative_embeds=)``, default the null prompt).
        guidance_sigma_min: the guidance interval: only frames whose sigma is above it are guided, a
            number in [0, 1); None: ``model_cfg.guidance_sigma_min`` (the demo preset's 0.85).
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
        attn_fp8: bool = False,
        guidance_scale: float | None = None,
        guidance_sigma_min: float | None = None,
    ) -> None:
        self.guidance_scale = check_guidance(
            model_cfg.guidance_scale if guidance_scale is None else guidance_scale, "guidance_scale"
        )
        self.guidance_sigma_min = check_sigma_min(
            model_cfg.guidance_sigma_min if guidance_sigma_min is None else guidance_sigma_min,
            "guidance_sigma_min",
        )
        if not isinstance(attn_fp8, bool):
            raise TypeError(f"attn_fp8 must be a bool, got {type(attn_fp8).__name__}")
        if kv_dtype not in (None, KV_FP8):
            raise ValueError(f"kv_dtype must be None or {KV_FP8!r}, got {kv_dtype!r}")
        self.kv_dtype = kv_dtype
        meth = get_method("rolling-forcing" if method is None else method)
        mode = resolve_positions(pipe_cfg, positions)
        if (
            not meth.sequential
            and method is not None
            and meth.pipeline_config(pipe_cfg.dtype, pipe_cfg.positions) != pipe_cfg
        ):
            raise ValueError(f"method={meth.name!r} does not match pipe_cfg {pipe_cfg}")
        upd_mode = resolve_update_mode(meth, backend, merged, static)
        self.method = meth
        self._timing: Timing = meth if meth.sequential else pipe_cfg
        self.merged = upd_mode is not UpdateMode.TWO_PASS
        self.static = static
        if compile not in (None, False) and not self.merged:
            raise ValueError("compile= applies to the merged forward only; it needs merged=True")
        if compile not in (None, False) and meth.sequential and not self.static:
            raise ValueError(
                f"compile= applies to Rolling Forcing's merged forward only, not method={meth.name!r}"
            )
        self.model, self.model_cfg, self.pipe_cfg = model, model_cfg, pipe_cfg
        self.backend = backend
        self.positions = mode
        self._pending_prompt: Switch | None = None
        self._pending_restart: torch.Tensor | None = None
        self.state: StreamState | None = None
        layout = MergedLayout.from_configs(model_cfg, pipe_cfg, mode)
        if self.static:
            layout = sequential.static_layout(meth, meth.tokens_per_block(model_cfg), mode)
        merged_fwd = None
        if attn_fp8 and upd_mode is not UpdateMode.MERGED:
            raise ValueError(
                "attn_fp8=True applies to the merged forward's self-attention (ops.attention_block_table); "
                f"this stream runs {upd_mode.name.lower()} (use merged=True or None with Rolling Forcing)"
            )
        self.attn_fp8 = attn_fp8
        if upd_mode is UpdateMode.MERGED:
            merged_fwd = MergedForward(model, layout, backend, compile, kv_dtype == KV_FP8, attn_fp8)
        frames = layout.frames if merged_fwd is not None else 0
        spec = DriverSpec(
            meth, pipe_cfg, mode, upd_mode, frames, self.guidance_scale, self.guidance_sigma_min
        )
        self._passes = LocalPasses(model, spec, backend, merged_fwd)
        self._driver = StreamDriver(model, spec, self._passes)

    @property
    def stats(self) -> ForwardStats:
        """Measured forward counts of the last (or running) stream by kind and input signature."""
        return self._passes.stats

    # ---- public API ----------------------------------------------------------------------------
    def set_prompt(
        self,
        text_embeds: torch.Tensor,
        recache: bool = False,
        *,
        restart: bool = False,
        negative_embeds: torch.Tensor | None = None,
    ) -> None:
        """Switch the prompt of the running stream; takes effect at its next window.

        A new :meth:`stream` call starts from the ``text_embeds`` given to it and drops a switch that is
        still pending (the stream it was meant for has no next window). Of two calls before the next
        chunk the later one wins.

        The text k/v cache is recomputed for ``text_embeds`` ``[B, L<=text_len, text_dim]``. With
        ``recache=True`` the clean blocks still in the KV cache are re-encoded under the new prompt:
        Rolling Forcing oldest first, each attending to the cached blocks before it (this project's
        adaptation of LongLive's KV re-cache); LongLive as the original (one pass, sink protected). A
        sequential method takes the switch at its next block. ``recache=True`` with a method whose
        original has no re-cache (Self-Forcing, CausVid) raises ``ValueError``.

        ``restart=True`` (any method; not with ``recache``) *restarts* the stream under the new prompt
        instead of continuing it (the KV cache cleared at the switch: it follows the new prompt at once at
        the price of a cut, the trade-off LongLive's re-cache addresses): the KV cache, the clean
        context and the blocks in flight (partly denoised, never shown) are dropped, and the next chunk
        is the first block of a new stream of the new prompt; block numbers run on, and block ``b`` of
        the new stream draws the initial noise block ``offset + b`` of the old one would have drawn
        (:class:`~rolling_forcing.stream.ShiftedNoise`). A restart less than a window before the end runs
        a window's worth of blocks and shows the ones left. The next chunk then costs a stream start
        (Rolling Forcing's warm-up windows), not a steady window.

        A guided stream takes the new prompt's ``negative_embeds`` (same shape; None: the null prompt);
        an unguided one refuses them. ``ValueError`` for a new prompt whose batch differs from the
        running stream's (at the switch).
        """
        if recache and restart:
            raise ValueError("recache=True and restart=True: a restart drops the KV cache; choose one")
        if recache and self.method.recache == "none":
            raise ValueError(
                f"recache=True: method {self.method.name!r} has no KV re-cache in its original (LongLive's "
                "re-cache is method='longlive'); switch with recache=False"
            )
        self.model.check_context(text_embeds)
        batch = self._batch(text_embeds, negative_embeds)
        if restart and self.state is not None:
            rows = self.state.cache.layers[0].k.shape[0]
            if batch.shape[0] != rows:
                raise ValueError(f"restart: new prompt batch {batch.shape[0]} != stream batch {rows}")
        if restart:
            self._pending_prompt, self._pending_restart = None, batch
        else:
            self._pending_prompt, self._pending_restart = (batch, bool(recache)), None

    def _batch(self, text_embeds: torch.Tensor, negative_embeds: torch.Tensor | None) -> torch.Tensor:
        """The stream's prompt batch: ``[prompt | negative]`` when guided, else the prompt."""
        if self._driver.spec.guided:
            return guided_embeds(text_embeds, negative_embeds)
        if negative_embeds is not None:
            raise ValueError(
                "negative_embeds applies to a guided stream (guidance_scale > 1); this stream has "
                f"guidance_scale={self.guidance_scale}"
            )
        return text_embeds

    @torch.no_grad()
    def stream(
        self,
        text_embeds: torch.Tensor,
        num_blocks: int,
        *,
        generator: torch.Generator | None = None,
        noise: torch.Tensor | NoiseSource | None = None,
        negative_embeds: torch.Tensor | None = None,
    ) -> Generator[Chunk, None, None]:
        """Generate ``num_blocks`` blocks, yielding each :class:`Chunk` as soon as it is final.

        Args:
            text_embeds: ``[B, L<=text_len, text_dim]`` prompt embeddings.
            num_blocks: blocks to generate (Rolling Forcing: >= ``window_blocks``; in ``"absolute"`` mode
                at most ``StreamMethod.max_blocks``: the RoPE table, or Self-Forcing's and CausVid's
                21-frame cache).
            generator: RNG of all noise draws (global RNG when None).
            noise: initial noise ``[B, num_blocks*fpb, C, H, W]`` (the original's ``noise`` argument), or a
                :class:`NoiseSource`; None draws it from ``generator`` in the original order.
            negative_embeds: a guided stream's negative prompt (``text_embeds``' shape; None: the null
                prompt, zeros); ``ValueError`` for an unguided stream. Chunks hold the ``B`` prompt rows.

        A restarting switch (``set_prompt(..., restart=True)``) runs the rest as a new stream of the new
        prompt; chunk blocks (and ``Chunk.window``, the calls since this stream began) run on over it.
        """
        check_method_stream(self.model, self.method, self.pipe_cfg, text_embeds, num_blocks, self.positions)
        batch = self._batch(text_embeds, negative_embeds)
        self._pending_prompt, self._pending_restart = None, None
        self._passes.stats = ForwardStats()
        offset, calls = 0, 0  # blocks and calls of the segments before a restart
        base: NoiseSource | None = None  # the first segment's noise (its prompt rows)
        while True:
            seg_noise = noise if base is None else ShiftedNoise(base, offset)
            seg_blocks = max(num_blocks - offset, self._min_blocks())
            st = self._driver.start(
                self.model_cfg,
                batch,
                seg_blocks,
                generator=generator,
                noise=seg_noise,
                kv_dtype=self.kv_dtype,
            )
            if base is None:
                base = st.noise.inner if isinstance(st.noise, GuidedNoise) else st.noise
            self.state = st
            run = self._driver.run(st, self._take_prompt)
            for chunk in run:
                block = offset + chunk.block
                last = block == num_blocks - 1
                yield Chunk(block, chunk.latents, chunk.final, last, calls + chunk.window)
                if last:
                    run.close()
                    self.state = None
                    return
                if self._pending_restart is not None:
                    run.close()
                    batch, self._pending_restart = self._pending_restart, None
                    offset, calls = block + 1, calls + chunk.window + 1
                    break
            else:  # pragma: no cover - the loop ends at the last block
                self.state = None
                return

    def _min_blocks(self) -> int:
        """The shortest stream of this method (Rolling Forcing: one window of blocks; sequential: 1)."""
        return 1 if self.method.sequential else self.pipe_cfg.window_blocks

    def _take_prompt(self, plan: Plan) -> Switch | None:
        """The switch made by :meth:`set_prompt`, taken at the first call that may start a prompt."""
        if self._pending_prompt is None or not plan.prompt_boundary:
            return None
        switch, self._pending_prompt = self._pending_prompt, None
        assert self.state is not None
        batch = self.state.cache.layers[0].k.shape[0]
        if switch[0].shape[0] != batch:
            raise ValueError(f"new prompt batch {switch[0].shape[0]} != stream batch {batch}")
        return switch


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
