"""Plain reference loop of the sequential AR video-diffusion streams: Self-Forcing, CausVid, LongLive.

Re-states in its own words the per-block loops of guandeh17/Self-Forcing @ 33593df
(``pipeline/causal_inference.py``), tianweiy/CausVid @ ca21150 (``causvid/models/wan/causal_inference.py``)
and NVlabs/LongLive v1.0 @ e52d9ef (``pipeline/interactive_causal_inference.py``) with the kv-cache branch of
their ``CausalWanSelfAttention`` (LongLive's ``wan/modules/causal_model.py``, a superset of the others):

* one contiguous KV buffer per layer with ``global_end`` / ``local_end`` token indices; every call ropes
  its queries and keys at the absolute frame ``current_start // tokens_per_frame`` and writes its roped
  keys *before* attending;
* with a local window (``local_attn_frames``), a call that brings new tokens into a full buffer shifts the
  tokens after the sink left by the overflow (the sink never moves) and writes at the end;
* a *recompute* (a call ending at or before ``global_end`` and starting after frame 0) does not write into
  the sink tokens and does not advance the indices;
* attention, no mask: with a sink, the sink tokens plus the last ``max_attention - sink`` tokens ending at
  the call (never overlapping the sink); without, the last ``max_attention`` tokens;
* per block of ``frames_per_block`` frames: the pre-drawn noise, one call per step, after each step but the
  last a fresh ``randn`` of the block's shape from ``generator``; the block's output is the last step's x0;
  then one call on that x0 at t = 0 (its k/v persist);
* ``relative_positions`` (LongLive's ``causal_model_infinity.py``): positions are buffer frame indices;
* prompt switch (LongLive): at the first block starting at or after a switch frame, the new prompt's text
  k/v are used from then on and (``recache_frames``) one t = 0 call over the last
  ``min(recache_frames, start)`` output frames writes their k/v under the new prompt.

Its bookkeeping is independent of ``rolling_forcing.sequential`` (the thing it checks). It drives a model
through ``text_kv(context)`` and ``forward_with(x, t, text_kv, attn_fn)`` like
:mod:`reference.rolling_forcing`. Depends on torch only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from reference.attention import attention
from reference.rope3d import rope3d


def _nearest(table_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return torch.argmin((table_t[None, :] - t[:, None]).abs(), dim=1)


def sequential_reference(
    model: Any,
    text_embeds: torch.Tensor,
    noise: torch.Tensor,
    *,
    denoising_timesteps: Sequence[float],
    sigmas: torch.Tensor,
    timesteps: torch.Tensor,
    tokens_per_frame: int,
    num_heads: int,
    frames_per_block: int = 3,
    cache_frames: int = 21,
    local_attn_frames: int = -1,
    sink_frames: int = 0,
    switches: Mapping[int, torch.Tensor] | None = None,
    recache_frames: int | None = None,
    relative_positions: bool = False,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Run the whole stream and return every latent ``[B, F, C, H, W]`` (each block's last-step x0).

    Args:
        model: object with ``text_kv`` and ``forward_with`` (e.g. ``rolling_forcing.model.CausalWanModel``).
        text_embeds: ``[B, L, text_dim]`` first prompt.
        noise: initial noise of all frames ``[B, F, C, H, W]``, F a multiple of ``frames_per_block``.
        denoising_timesteps: the timesteps the DiT sees, noisiest first.
        sigmas, timesteps: the scheduler table (float32 ``[1000]`` each) at the method's shift.
        tokens_per_frame, num_heads: model geometry.
        cache_frames: buffer length when ``local_attn_frames == -1`` (Self-Forcing/CausVid: 21; longer
            streams raise, as the original's slice assignment fails).
        local_attn_frames: -1 (global cache) or the buffer and attention length in frames (LongLive 12).
        sink_frames: frames never evicted (LongLive 3).
        switches: frame index -> new prompt ``[B, L, text_dim]``.
        recache_frames: frames re-cached at a switch (LongLive 12); None: no re-cache.
        relative_positions: LongLive's "infinity" cache: keys stored un-roped; every call ropes the
            buffer's frames at their buffer index (sink 0.., then the window) and its queries at the
            index where they are written; no position limit. False: absolute positions (the default).
        generator: RNG of the re-noising draws.
    """
    bsz, num_frames = noise.shape[:2]
    fpb = frames_per_block
    T = tokens_per_frame
    S = (cache_frames if local_attn_frames == -1 else local_attn_frames) * T
    MA = S
    sink = sink_frames * T
    dtype = noise.dtype
    text_kv = model.text_kv(text_embeds)
    head_dim = text_kv[0][0].shape[-1]
    caches: list[dict[str, Any]] = [
        {
            "k": torch.zeros(bsz, S, num_heads, head_dim, dtype=dtype),
            "v": torch.zeros(bsz, S, num_heads, head_dim, dtype=dtype),
            "g": 0,
            "l": 0,
        }
        for _ in text_kv
    ]

    def make_attn(current_start: int) -> Any:
        def attn(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: Any) -> torch.Tensor:
            c = caches[layer]
            n = q.shape[1]
            current_end = current_start + n
            recompute = current_end <= c["g"] and current_start > 0
            if local_attn_frames != -1 and current_end > c["g"] and n + c["l"] > S:
                ev = n + c["l"] - S
                rolled = c["l"] - ev - sink
                for name in ("k", "v"):
                    c[name][:, sink : sink + rolled] = c[name][:, sink + ev : sink + ev + rolled].clone()
                local_end = c["l"] + current_end - c["g"] - ev
            else:
                local_end = c["l"] + current_end - c["g"]
            if local_end > S:
                raise ValueError(f"the stream outgrows the {S // T}-frame KV cache (no local window)")
            local_start = local_end - n
            if relative_positions:  # un-roped cache; every call ropes the buffer by frame index
                qr = rope3d(q, q, grid, start_frame=local_start // T)[0]
                kr = k
            else:
                qr, kr = rope3d(q, k, grid, start_frame=current_start // T)
            write = max(local_start, sink) if recompute else local_start
            off = write - local_start
            c["k"][:, write:local_end] = kr[:, off:]
            c["v"][:, write:local_end] = v[:, off:]
            if current_end > c["g"]:
                c["g"], c["l"] = current_end, local_end
            ck = c["k"]
            if relative_positions:
                buf = ck[:, :local_end].contiguous()
                ck = rope3d(buf, buf, (local_end // T, grid[1], grid[2]), start_frame=0)[1]
            if sink:
                lo = max(sink, local_end - (MA - sink))
                keys = torch.cat([ck[:, :sink], ck[:, lo:local_end]], dim=1)
                vals = torch.cat([c["v"][:, :sink], c["v"][:, lo:local_end]], dim=1)
            else:
                lo = max(0, local_end - MA)
                keys, vals = ck[:, lo:local_end], c["v"][:, lo:local_end]
            return attention(qr, keys, vals)  # type: ignore[return-value]

        return attn

    def call(x: torch.Tensor, t: torch.Tensor, start_frame: int) -> torch.Tensor:
        flow = model.forward_with(x, t, text_kv, make_attn(start_frame * T))
        sig, ts = sigmas.double(), timesteps.double()
        sigma = sig[_nearest(ts, t.flatten().double())].view(*t.shape, 1, 1, 1)
        return (x.double() - sigma * flow.double()).to(flow.dtype)

    steps = [float(t) for t in denoising_timesteps]
    pending = sorted((switches or {}).items())
    output = torch.zeros_like(noise)
    for cs in range(0, num_frames, fpb):
        if pending and cs >= pending[0][0]:
            text_kv = model.text_kv(pending.pop(0)[1])
            n = min(recache_frames or 0, cs)
            if n:
                call(output[:, cs - n : cs], torch.zeros(bsz, n), cs - n)
        x = noise[:, cs : cs + fpb]
        for i, t in enumerate(steps):
            x0 = call(x, torch.full((bsz, fpb), t, dtype=torch.float32), cs)
            if i + 1 < len(steps):
                eps = torch.randn(x0.shape, generator=generator, dtype=x0.dtype)
                sigma = sigmas[_nearest(timesteps, torch.tensor([steps[i + 1]]))].reshape(1, 1, 1, 1, 1)
                x = ((1 - sigma) * x0 + sigma * eps).type_as(eps)
        output[:, cs : cs + fpb] = x0
        call(x0, torch.zeros(bsz, fpb), cs)
    return output


__all__ = ["sequential_reference"]
