"""The Rolling Forcing stream sharded TP (heads) x SP (tokens/queries) over ``plan.world_size`` ranks.

Every rank runs the same window loop as :class:`rolling_forcing.pipeline.RollingForcingPipeline` in
lockstep; only the forwards are split. By default (``merged``) that is **one merged forward per window**
(the cache update of window w-1's start block at t = 0 and the denoise of window w, 3 + 15 frames,
static shapes, :mod:`rolling_forcing.merged`'s plan); ``merged=False`` runs the two passes (denoise,
then the cache update) separately.

**Per forward** (``L`` tokens of the pass, rank ``r``, plan ``tp x sp``):

* *Outside attention* (adaLN modulation, norms, q/k/v/o projections, cross-attention to the text, FFN,
  head) each rank works on its contiguous **token shard** ``local_tokens(L, plan, r)`` with all heads;
  weights are replicated. The model's own :class:`~rolling_forcing.model.WanBlock` and
  :class:`~rolling_forcing.model.Head` modules run on the shard: the per-frame modulation is expanded to
  one row per token and the block is called with the grid ``(L_local, 1, 1)`` (one "frame" per token),
  which is the same arithmetic as the unsharded per-frame broadcast. The patch embedding and the time
  embedding are computed replicated (a few per cent of one layer) and sliced.
* *Self-attention* goes through :func:`sharding.attention.sharded_attention`: an all-to-all in the TP
  group regroups q, k, v to (head group x query shard), an all-gather in the SP group collects all of
  the pass's new keys of the local heads, then the local step (``attention_fn``) ropes them, writes the
  cache (update pass), and attends over [cache keys] + [own keys] exactly as the unsharded pipeline
  (:func:`rolling_forcing.attend.attend_cache`, the unsharded pipeline's code on ``H/tp`` heads;
  partials merged by log-sum-exp); the inverse all-to-all restores token shards.
* The head's output ``[B, L_local, patch_out]`` is all-gathered over all ranks, so every rank holds the
  full flow prediction; x0, re-noising and the noise draws are then replicated (cheap elementwise work;
  every rank draws the same noise from the same generator state). Every rank therefore yields the same
  chunks; rank 0 hands them to the caller.
* *The merged forward* (:meth:`RankStream._merged_attn`): the same token sharding over 18 frames; the
  local step runs the unsharded merged forward's attention on the local heads and query shard: rope at
  ``MergedIndex.frame_positions``, ``ops.kv_cache_write_at`` of the update block into this rank's
  cache, roped copies, one ``ops.attention_block_table`` with the rows of the query groups the shard
  holds. In the last layer the update tokens of each shard stop after their k/v
  (``forward(context_frames=fpb)``) and only the window's tokens reach the head and its all-gather.
* *The cache-update pass* (two-pass mode) only needs its k/v writes (``forward(...,
  context_frames=F)``, as the unsharded pipeline's ``forward_with(..., context_frames=F)``): its last
  layer stops after the k/v regroup and the write (one placeholder query per rank keeps
  :func:`~sharding.attention.sharded_attention`'s local step running), and the head and its all-gather
  are skipped.

**KV cache per head group, sharded along SP** (``kv_cache="sp_sharded"``, the default). Rank ``r``
keeps a :class:`~rolling_forcing.cache.RollingKVCache` of only its heads ``local_heads(plan, r)`` and,
of every cached block, only its SP index's share of the block's tokens (:mod:`sharding.kv_shard`):
buffers ``[B, slots * t_s, H/tp, D]``, ``1 / (tp sp)`` of the cache per rank. Every query attends to
every cached key, so each attention layer all-gathers the layer's shares in the SP group into one
transient whole-key-range buffer, runs the local step on it (writes included) and keeps its own tokens
back: the per-layer gather of every key that the communication model prices and the footprint model's
``kv_gather_buffer``. ``kv_cache="replicated"`` keeps the whole key range on every SP rank instead
(``[B, S, H/tp, D]``: ``sp`` x the memory, no cache traffic; the only K/V collective is then the
all-gather of the pass's new tokens). Both give the same stream bit for bit (same values, same
arithmetic). Ranks report their allocations (``"kv_bytes"``, ``"text_kv_bytes"``,
``"kv_gather_bytes"``, ``"weight_bytes"`` in :attr:`ShardedRollingForcingPipeline.last_results`);
``perf/footprint_check.py`` compares them with ``perf.footprint``'s formulas.

Use :class:`ShardedRollingForcingPipeline` to run a stream on CPU ranks spawned by
:func:`sharding.launch.launch` (rank 0 streams each chunk back as soon as it is final); use
:class:`RankStream` inside ranks started some other way (``torchrun``, the XLA process group on
Trainium).

**Prompt switches** are a schedule fixed before the stream starts: ``set_prompt(embeds, recache,
window=w)`` on :class:`ShardedRollingForcingPipeline` (or ``prompts={w: (embeds, recache)}`` to
:meth:`RankStream.stream`) is pickled into every rank's job, so every rank applies it at the start of
window ``w`` with no message at all: the ranks stay in lockstep by construction and the result is exactly
the unsharded pipeline's ``set_prompt`` called after the chunk of window ``w - 1`` (the same steps:
a pending merged update of the old prompt runs alone first, text k/v recomputed, optional re-cache of
the clean blocks still cached). A switch *while* the ranks run is refused: they run ahead of the
consumer, so "the next window" would depend on timing. Batch > 1 is untested.
"""

from __future__ import annotations

import ctypes
import dataclasses
import datetime
import io
import multiprocessing as mp
import os
import queue as queue_mod
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from rolling_forcing.config import ModelConfig, PipelineConfig, check_guidance, check_sigma_min
from rolling_forcing.driver import (
    UpdateMode,
    check_method_stream,
    num_calls,
    resolve_positions,
    resolve_update_mode,
)
from rolling_forcing.methods import StreamMethod, get_method
from rolling_forcing.model import (
    CausalWanModel,
)
from rolling_forcing.stream import Chunk, NoiseSource
from sharding.attention import (
    DEFAULT_TIMEOUT_S,
    build_groups,
    local_heads,
)
from sharding.kv_shard import check_compact_layout, check_kv_cache_layout
from sharding.launch import DEFAULT_PRELOAD, LaunchError, launch
from sharding.plan import AttentionShape, ShardingPlan
from sharding.plan import plan as make_plan
from sharding.rank_stream import RankStream
from sharding.stream_checks import PromptSchedule, check_plan, check_prompts

__all__ = [
    "PromptSchedule",
    "RankStream",
    "ShardedRollingForcingPipeline",
    "attention_shape",
    "pipeline_plan",
]

PRELOAD: tuple[str, ...] = (
    *DEFAULT_PRELOAD,
    "rolling_forcing.driver",
    "rolling_forcing.pipeline",
    "sharding.stream_checks",
    "sharding.kv_shard",
    "sharding.rank_stream",
    "sharding.pipeline",
)


def attention_shape(model_cfg: ModelConfig, pipe_cfg: PipelineConfig, batch: int = 1) -> AttentionShape:
    """The self-attention shape of a full denoise window of this stream (what the planner models)."""
    return AttentionShape(
        num_queries=pipe_cfg.window_blocks * pipe_cfg.tokens_per_block(model_cfg),
        num_keys=pipe_cfg.key_budget_tokens(model_cfg),
        head_dim=model_cfg.head_dim,
        dtype_bytes=pipe_cfg.torch_dtype.itemsize,
        batch=batch,
    )


def pipeline_plan(
    model_cfg: ModelConfig, pipe_cfg: PipelineConfig, cores: int, *, tp: int | None = None
) -> ShardingPlan:
    """The TP x SP plan of a stream on ``cores`` ranks (``tp`` forces a factorisation).

    Raises ``ValueError`` if no balanced plan exists (see :func:`sharding.plan.plan`) or if a block has
    fewer tokens than ranks (the cache-update pass of one block must give every rank at least a token).
    """
    p = make_plan(model_cfg.num_heads, cores, shape=attention_shape(model_cfg, pipe_cfg), tp=tp)
    check_plan(p, model_cfg, pipe_cfg)
    return p


@dataclass(frozen=True)
class _Job:
    """Everything a spawned rank needs (pickled once per rank)."""

    model: CausalWanModel
    model_cfg: ModelConfig
    pipe_cfg: PipelineConfig
    plan: ShardingPlan
    backend: str | None
    positions: str
    text_embeds: torch.Tensor
    num_blocks: int
    generator_state: torch.Tensor
    noise: torch.Tensor | None
    timeout_s: float
    return_latents: bool
    merged: bool
    prompts: tuple[tuple[int, torch.Tensor, bool], ...] = ()
    method: StreamMethod | str = "rolling-forcing"
    upfront: bool = True
    static: bool = False
    kv_cache: str = "sp_sharded"
    compile: Any = None


_PR_SET_PDEATHSIG = 1  # linux/prctl.h
WATCHDOG_PERIOD_S = 0.2


def _process_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def end_with_parent(main_pid: int, cancel: Any = None) -> threading.Thread:
    """Make this rank process end when the stream's main process ends, however it ends.

    Two guards: on Linux ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` kills the rank if its parent process (the
    multiprocessing forkserver, not the main process) dies; and a daemon watchdog thread checks every
    ``WATCHDOG_PERIOD_S`` that ``main_pid`` still runs and that ``cancel`` (a ``multiprocessing`` Event,
    set when the consumer closes the stream early) is not set, else ``os._exit(1)`` (no cleanup: the
    collectives of the other ranks would wait for this one). Returns the watchdog thread.
    """
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):  # no prctl: the watchdog alone
            pass

    def watch() -> None:
        while True:
            if not _process_alive(main_pid) or (cancel is not None and cancel.is_set()):
                os._exit(1)
            time.sleep(WATCHDOG_PERIOD_S)

    thread = threading.Thread(target=watch, name="end-with-parent", daemon=True)
    thread.start()
    return thread


def _rank_main(
    rank: int, world: int, job: _Job, chunks: Any, cancel: Any = None, main_pid: int | None = None
) -> dict[str, Any]:
    """Body of one spawned rank: build groups, run the stream, rank 0 puts every chunk on ``chunks``.

    With ``main_pid`` the rank ends when that process ends or ``cancel`` is set (:func:`end_with_parent`).
    """
    if main_pid is not None:
        end_with_parent(main_pid, cancel)
    if world != job.plan.world_size:
        raise ValueError(f"launched {world} ranks for a plan of {job.plan.world_size}")
    groups = build_groups(job.plan, timeout_s=job.timeout_s)
    gather = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=job.timeout_s))
    runner = RankStream(
        job.model, job.model_cfg, job.pipe_cfg, groups,
        backend=job.backend, positions=job.positions, gather_group=gather, merged=job.merged,
        method=job.method, static=job.static, kv_cache=job.kv_cache, compile=job.compile,
    )  # fmt: skip
    gen = torch.Generator()
    gen.set_state(job.generator_state)
    kept: list[torch.Tensor] = []
    prompts = {w: (emb, recache) for w, emb, recache in job.prompts}
    noise: Any = job.noise
    if noise is None and not job.upfront:  # per-block draws from the replicated generator
        noise = NoiseSource(
            job.text_embeds.shape[0], job.model_cfg.latent_frame_shape(), job.pipe_cfg.frames_per_block,
            job.num_blocks, job.pipe_cfg.torch_dtype, generator=gen, upfront=False,
        )  # fmt: skip
    for chunk in runner.stream(job.text_embeds, job.num_blocks, generator=gen, noise=noise, prompts=prompts):
        if rank == 0 and chunks is not None:
            buf = io.BytesIO()
            torch.save((chunk.block, chunk.latents, chunk.final, chunk.last, chunk.window), buf)
            chunks.put(buf.getvalue())
        if job.return_latents:
            kept.append(chunk.latents)
    latents = torch.cat(kept, dim=1) if kept else None
    heads = local_heads(job.plan, rank)
    return {
        "rank": rank,
        "heads": (heads.start, heads.stop),
        "cache_shape": runner.cache_shape,
        "kv_bytes": runner.kv_bytes,
        "text_kv_bytes": runner.text_kv_bytes,
        "kv_gather_bytes": runner.kv_gather_bytes,
        "text_gather_bytes": runner.text_gather_bytes,
        "weight_bytes": sum(p.nbytes for p in job.model.parameters()),
        "latents": latents,
        "forwards": dict(runner.stats.forwards),
        "signatures": dict(runner.stats.signatures),
        "graphs": [dataclasses.asdict(g) for g in runner.compiled_graphs],
    }


class ShardedRollingForcingPipeline:
    """Rolling Forcing on ``cores`` CPU ranks (gloo, spawned per stream); same interface as the pipeline.

    Args:
        model: the DiT (pickled to every rank; weights replicated).
        model_cfg, pipe_cfg: configurations.
        cores: number of ranks (>= 1). ``tp`` forces the heads split (default: the planner's choice at
            this stream's window shape, :func:`pipeline_plan`).
        backend, positions: as :class:`rolling_forcing.pipeline.RollingForcingPipeline`.
        merged: as :class:`~rolling_forcing.pipeline.RollingForcingPipeline`: True: one merged forward
            per window on every rank (:meth:`RankStream._merged_windows`); False: two passes; None
            (default): merged where ``ops.attention_block_table`` runs on ``backend``
            (``ops.has_kernel``), else two-pass. ``self.merged`` tells which. ``merged=True`` on a
            backend without that op raises ``NotImplementedError``.
        compile: None/False: eager forwards; else (Rolling Forcing's merged forward only) every rank
            compiles its forward whole with ``torch.compile(fullgraph=True)`` (True: torch's default
            backend; or a backend name, or a picklable backend callable): the collectives are functional
            ops inside the graph (:mod:`sharding.collectives`), so one graph per forward, no graph break.
            Each rank's graphs are reported in :attr:`last_results` (``"graphs"``: per compiled graph its
            collectives and kernel calls, :class:`sharding.compiled.GraphRecord`).
        method: as :class:`~rolling_forcing.pipeline.RollingForcingPipeline`; a sequential method runs
            two-pass by default (``merged`` None -> False), ``merged=True`` batches each block's cache
            update with the next block's first denoise call (:meth:`RankStream._batched_attn`) and
            ``static=True`` runs every call as one static-shape merged forward, both as the unsharded
            stream; its prompt switches use ``window`` = the step index, a multiple of the method's
            steps (the block's first call).
        static: as :class:`~rolling_forcing.pipeline.RollingForcingPipeline` (sequential methods only).
        kv_cache: ``"sp_sharded"`` (default), ``"replicated"`` or ``"sp_compact"`` (a ring one slot
            shorter and the text k/v token-sharded; Rolling Forcing, sp > 1, eager or ``compile=``): how
            a head group's SP ranks keep the KV cache (module docstring; :class:`RankStream`;
            :mod:`sharding.kv_shard`).
        timeout_s: timeout of every collective: a rank that dies or hangs makes the others fail after
            at most this long and :meth:`stream` raises :class:`sharding.launch.LaunchError` naming it.
        guidance_scale, guidance_sigma_min: classifier-free guidance as the unsharded pipeline's (None:
            ``model_cfg``'s); the negative prompt is the null prompt (zeros), on every rank.

    Raises ``ValueError`` for a plan that cannot be built (see :func:`pipeline_plan`).
    """

    def __init__(
        self,
        model: CausalWanModel,
        model_cfg: ModelConfig,
        pipe_cfg: PipelineConfig,
        *,
        cores: int,
        tp: int | None = None,
        backend: str | None = None,
        positions: str | None = None,
        merged: bool | None = None,
        compile: Any = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        method: str | StreamMethod | None = None,
        static: bool = False,
        kv_cache: str = "sp_sharded",
        guidance_scale: float | None = None,
        guidance_sigma_min: float | None = None,
    ) -> None:
        if guidance_scale is not None:
            model_cfg = dataclasses.replace(model_cfg, guidance_scale=check_guidance(guidance_scale))
        if guidance_sigma_min is not None:
            model_cfg = dataclasses.replace(model_cfg, guidance_sigma_min=check_sigma_min(guidance_sigma_min))
        self.guidance_scale, self.guidance_sigma_min = model_cfg.guidance_scale, model_cfg.guidance_sigma_min
        mode = resolve_positions(pipe_cfg, positions)
        self.kv_cache = check_kv_cache_layout(kv_cache)
        self.method = get_method("rolling-forcing" if method is None else method)
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        upd_mode = resolve_update_mode(self.method, backend, merged, static)
        if compile not in (None, False) and (upd_mode is not UpdateMode.MERGED or self.method.sequential):
            raise ValueError(
                "compile= applies to Rolling Forcing's merged forward only (merged=True or None with a "
                f"backend that has ops.attention_block_table), not method={self.method.name!r}, "
                f"merged={merged}"
            )
        self.compile = compile
        self.merged: bool = upd_mode is not UpdateMode.TWO_PASS
        self.static = static
        self.plan = pipeline_plan(model_cfg, pipe_cfg, cores, tp=tp)
        check_compact_layout(self.kv_cache, self.method.sequential, self.plan)
        self.model, self.model_cfg, self.pipe_cfg = model, model_cfg, pipe_cfg
        self.backend, self.positions, self.timeout_s = backend, mode, timeout_s
        self.last_results: list[dict[str, Any]] | None = None
        self._prompts: dict[int, tuple[torch.Tensor, bool]] = {}
        self._streaming = False

    def set_prompt(
        self, text_embeds: torch.Tensor, recache: bool = False, *, window: int, restart: bool = False
    ) -> None:
        """Schedule a prompt switch at the start of ``window`` of the next :meth:`stream`.

        Same semantics as :meth:`rolling_forcing.pipeline.RollingForcingPipeline.set_prompt` called after
        the chunk of window ``window - 1`` (``chunk.window + 1`` is the window a switch made at that chunk
        takes effect): text k/v recomputed for ``text_embeds`` ``[B, L<=text_len, text_dim]``; with
        ``recache=True`` the clean blocks still cached are re-encoded under the new prompt; in merged mode
        the pending update of the old prompt runs alone first. The schedule is given to every rank when
        the stream starts, so all ranks switch at the same window with no message; it is consumed by that
        stream. A later call for the same window replaces the earlier one.

        Raises ``RuntimeError`` while a stream runs (the ranks run ahead of the consumer, so a switch
        made then could not be placed at a window exactly), ``ValueError``/``TypeError`` for bad
        embeddings, a negative or non-int ``window`` or a non-bool ``recache`` (the window's upper bound
        and the batch are checked by :meth:`stream`, before spawning). ``restart=True`` (the unsharded
        stream's restarting switch) raises ``NotImplementedError``: a sharded restart is a new
        :meth:`stream` of the new prompt.
        """
        if restart:
            raise NotImplementedError(
                "restart=True: the sharded stream has no restarting switch (its switches are scheduled "
                "before it starts); end the stream and start a new stream() of the new prompt"
            )
        if self._streaming:
            raise RuntimeError(
                "set_prompt during a running sharded stream is not supported: the ranks run ahead of the "
                "consumer, so the switch could not be placed at a window exactly; schedule it before "
                "stream() with set_prompt(embeds, recache, window=w)"
            )
        if isinstance(window, bool) or not isinstance(window, int):
            raise TypeError(f"window must be an int, got {type(window).__name__}")
        if window < 0:
            raise ValueError(f"window must be >= 0, got {window}")
        if not isinstance(recache, bool):
            raise TypeError(f"recache must be a bool, got {type(recache).__name__}")
        self.model.check_context(text_embeds)
        self._prompts[window] = (text_embeds.detach().clone(), recache)

    def stream(
        self,
        text_embeds: torch.Tensor,
        num_blocks: int,
        *,
        generator: torch.Generator | None = None,
        noise: torch.Tensor | None = None,
        return_latents: bool = False,
        upfront: bool = True,
    ) -> Iterator[Chunk]:
        """Spawn the ranks, stream the video, yield each chunk as soon as rank 0 has it final.

        Arguments as :meth:`rolling_forcing.pipeline.RollingForcingPipeline.stream` (``generator``'s
        state is copied to every rank; it is not advanced here). ``return_latents``: every rank also
        returns its copy of all latents in :attr:`last_results` (for equivalence checks).

        The prompt switches scheduled with :meth:`set_prompt` apply to this stream (and are consumed);
        every rank's forward counts come back in :attr:`last_results` (``"forwards"``: kind -> count,
        ``"signatures"``: (kind, input signature) -> count, see :attr:`RankStream.stats`).

        ``upfront``: without ``noise``, draw the initial noise up front (the original's RNG order) or per
        block (False: constant memory in the stream length; see :class:`~rolling_forcing.stream.NoiseSource`).

        Raises :class:`sharding.launch.LaunchError` if a rank fails (its traceback in the message).
        Closing the generator early (or an exception in the consumer) cancels the ranks: they exit within
        about ``WATCHDOG_PERIOD_S`` and the launcher reaps them before the close returns. Every rank also
        ends by itself when this process dies (:func:`end_with_parent`).
        """
        cfg = self.pipe_cfg
        check_method_stream(self.model, self.method, cfg, text_embeds, num_blocks, self.positions)  # first
        prompts, self._prompts = self._prompts, {}
        check_prompts(self.model, cfg, prompts, text_embeds.shape[0], num_blocks, self.method)
        state = generator.get_state() if generator is not None else torch.get_rng_state()
        job = _Job(
            self.model, self.model_cfg, cfg, self.plan, self.backend, self.positions,
            text_embeds.detach().clone(), num_blocks, state.clone(),
            None if noise is None else noise.detach().clone(), self.timeout_s, return_latents,
            self.merged, tuple((w, emb, rc) for w, (emb, rc) in sorted(prompts.items())), self.method,
            upfront, self.static, self.kv_cache, self.compile,
        )  # fmt: skip
        self._streaming = True
        try:
            yield from self._run(job, num_blocks)
        finally:
            self._streaming = False

    def _run(self, job: _Job, num_blocks: int) -> Iterator[Chunk]:
        """Launch the ranks of ``job`` and yield rank 0's chunks as they arrive."""
        cfg = self.pipe_cfg
        ctx: Any = mp.get_context("forkserver")
        ctx.set_forkserver_preload(list(PRELOAD))
        chunks = ctx.Queue()
        cancel = ctx.Event()
        box: dict[str, Any] = {}
        # the launch deadline (2 * timeout + 30 s) must cover the whole stream; dead or stuck ranks are
        # caught by the collectives' own timeout_s (every group above is created with it)
        launch_timeout = self.timeout_s * (num_calls(self.method, cfg, num_blocks) + 1)

        def run() -> None:
            try:
                box["results"] = launch(
                    _rank_main, self.plan.world_size, job, chunks, cancel, os.getpid(),
                    timeout_s=launch_timeout, preload=PRELOAD,
                )  # fmt: skip
            except BaseException as exc:  # handed to the consuming thread
                box["error"] = exc

        thread = threading.Thread(target=run, name="sharded-stream-launch", daemon=True)
        thread.start()
        received = 0
        try:
            while received < num_blocks:
                try:
                    payload = chunks.get(timeout=0.05)
                except queue_mod.Empty:
                    if thread.is_alive():
                        continue
                    try:
                        payload = chunks.get(timeout=0.5)
                    except queue_mod.Empty:
                        if "error" in box:
                            raise box["error"] from None
                        raise LaunchError(
                            f"the ranks finished after {received} of {num_blocks} chunks", 0
                        ) from None
                block, latents, final, last, window = torch.load(io.BytesIO(payload), weights_only=True)
                received += 1
                yield Chunk(block, latents, final, last, window)
        finally:
            if received < num_blocks:  # closed early or the consumer raised: stop the ranks now
                cancel.set()
            thread.join()
            chunks.close()
        if "error" in box:
            raise box["error"]
        self.last_results = box["results"]
