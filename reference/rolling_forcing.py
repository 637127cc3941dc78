"""Plain reference loop of Rolling Forcing inference with the original's cache semantics.

This re-states, in its own words, the original ``CausalInferencePipeline.inference_rolling_forcing`` and
the kv-cache branch of ``CausalWanSelfAttention.forward`` (github.com/TencentARC/RollingForcing @ a1477d0,
``pipeline/rolling_forcing_inference.py`` and ``wan/modules/causal_model.py``):

* one contiguous KV buffer per layer with ``global_end`` / ``local_end`` token indices;
* the denoise pass writes a *placeholder* (the window's first block, noisy) and advances the indices,
  evicting the oldest non-sink block by shifting the buffer left when it is full;
* the first block is stored un-roped (the sink) and re-roped before the working cache on every denoise
  pass; the update pass (t = 0) overwrites the block without advancing and reads the last
  ``max_attention`` tokens, so the sink drops out once the cache holds more than 7 blocks;
* RNG order: ``noise`` holds the initial noise of every frame (drawn up front by the caller); in each
  window, for each block not at the last level, a fresh normal sample of the *whole window* is drawn
  from ``generator`` and only that block's slice is used.

Its bookkeeping is independent of ``rolling_forcing.schedule`` (the thing it checks). It drives a model
object through the duck-typed methods ``text_kv(context)`` and ``forward_with(x, t, text_kv, attn_fn)``
(the layers' linear maps, norms and modulation), and supplies its own self-attention with
:func:`reference.rope3d` and :func:`reference.attention`. Depends on torch only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from reference.attention import attention
from reference.rope3d import rope3d


def _nearest(table_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return torch.argmin((table_t[None, :] - t[:, None]).abs(), dim=1)


def rolling_forcing_reference(
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
    max_attention_frames: int = 21,
    buffer_frames: int = 24,
    generator: torch.Generator | None = None,
    guidance_scale: float = 1.0,
    negative_embeds: torch.Tensor | None = None,
    guidance_sigma_min: float = 0.0,
) -> torch.Tensor:
    """Run the whole stream and return every latent ``[B, F, C, H, W]`` (final x0 of each block).

    Args:
        model: object with ``text_kv`` and ``forward_with`` (e.g. ``rolling_forcing.model.CausalWanModel``).
        text_embeds: ``[B, L, text_dim]``.
        noise: initial noise of all frames ``[B, F, C, H, W]``, F a multiple of ``frames_per_block``.
        denoising_timesteps: warped steps, noisiest first (1000, 952.38, ...).
        sigmas, timesteps: the scheduler table (float32 ``[1000]`` each).
        tokens_per_frame, num_heads: model geometry (keys are ``[B, S, num_heads, head_dim]``).
        frames_per_block, max_attention_frames, buffer_frames: the original's 3 / 21 / 24.
        generator: RNG of the re-noising draws.
        guidance_scale: classifier-free guidance; above 1 a second stream state (its own KV buffers and
            text k/v) runs under ``negative_embeds`` (None: zeros, the null prompt) on the same inputs,
            every denoise pass's x0 becomes ``x0_neg + guidance_scale * (x0 - x0_neg)`` (float32) on the
            frames whose sigma is above ``guidance_sigma_min`` (the prompt state's x0 on the others), and
            both states cache that x0. 1: the original.
    """
    bsz, num_frames = noise.shape[:2]
    fpb = frames_per_block
    num_blocks = num_frames // fpb
    steps = torch.tensor(list(denoising_timesteps), dtype=torch.float32)
    nsteps = len(steps)
    T = tokens_per_frame
    BL = fpb * T
    S = buffer_frames * T
    MA = max_attention_frames * T
    dtype = noise.dtype
    guided = guidance_scale != 1.0
    prompts = [text_embeds]
    if guided:
        prompts.append(torch.zeros_like(text_embeds) if negative_embeds is None else negative_embeds)
    text_kvs = [model.text_kv(e) for e in prompts]  # one stream state per prompt: text k/v, KV buffers
    head_dim = text_kvs[0][0][0].shape[-1]

    def new_caches() -> list[dict[str, Any]]:
        return [
            {
                "k": torch.zeros(bsz, S, num_heads, head_dim, dtype=dtype),
                "v": torch.zeros(bsz, S, num_heads, head_dim, dtype=dtype),
                "g": 0,
                "l": 0,
            }
            for _ in text_kvs[0]
        ]

    states = [new_caches() for _ in prompts]

    def make_attn(current_start: int, updating: bool, caches: list[dict[str, Any]]) -> Any:
        def attn(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: Any) -> torch.Tensor:
            c = caches[layer]
            f, hp, wp = grid
            csf = current_start // T
            qr, kr = rope3d(q, k, grid, start_frame=csf)
            cache_end = current_start + BL
            new = cache_end - c["g"]
            if new > 0 and new + c["l"] > S:
                ev = new + c["l"] - S
                rolled = c["l"] - ev - BL
                for name in ("k", "v"):
                    c[name][:, BL : BL + rolled] = c[name][:, BL + ev : BL + ev + rolled].clone()
                local_end = c["l"] + cache_end - c["g"] - ev
                ls = local_end - BL
                c["k"][:, ls:local_end] = kr[:, :BL]
            else:
                local_end = c["l"] + cache_end - c["g"]
                ls = local_end - BL
                c["k"][:, ls:local_end] = (k if ls == 0 else kr)[:, :BL]
            c["v"][:, ls:local_end] = v[:, :BL]
            if new > 0:
                c["g"], c["l"] = cache_end, local_end
            if ls == 0:
                return attention(qr, kr, v)  # type: ignore[return-value]
            if updating:
                lo = max(0, local_end - MA)
                wk = c["k"][:, lo:local_end].clone()
                wv = c["v"][:, lo:local_end]
                if lo == 0:
                    sink = wk[:, :BL].contiguous()
                    wk[:, :BL] = rope3d(sink, sink, (fpb, hp, wp), start_frame=0)[1]
                return attention(qr, wk, wv)  # type: ignore[return-value]
            wcm = MA - q.shape[1] - BL
            lo = max(BL, ls - wcm)
            wk, wv = c["k"][:, lo:ls], c["v"][:, lo:ls]
            sink_start = csf - (ls - lo) // T - fpb
            sink = c["k"][:, :BL].contiguous()
            ak = rope3d(sink, sink, (fpb, hp, wp), start_frame=sink_start)[1]
            keys = torch.cat([ak, wk, kr], dim=1)
            vals = torch.cat([c["v"][:, :BL], wv, v], dim=1)
            return attention(qr, keys, vals)  # type: ignore[return-value]

        return attn

    def denoise(x: torch.Tensor, t: torch.Tensor, start: int, updating: bool, i: int = 0) -> torch.Tensor:
        flow = model.forward_with(x, t, text_kvs[i], make_attn(start, updating, states[i]))
        sig, ts = sigmas.double(), timesteps.double()
        sigma = sig[_nearest(ts, t.flatten().double())].view(*t.shape, 1, 1, 1)
        return (x.double() - sigma * flow.double()).to(flow.dtype)

    output = torch.zeros_like(noise)
    noisy = torch.zeros_like(noise)
    shared_t = torch.ones(bsz, nsteps * fpb, dtype=torch.float32)
    for i, t in enumerate(reversed(steps.tolist())):
        shared_t[:, i * fpb : (i + 1) * fpb] *= t
    for w in range(num_blocks + nsteps - 1):
        sb, eb = max(0, w - nsteps + 1), min(num_blocks - 1, w)
        f0, f1 = sb * fpb, (eb + 1) * fpb
        nf = f1 - f0
        if nf == nsteps * fpb or f0 == 0:
            x_in = torch.cat([noisy[:, f0 : f1 - fpb], noise[:, f1 - fpb : f1]], dim=1)
        else:
            x_in = noisy[:, f0:f1]
        if nf == nsteps * fpb:
            t_in = shared_t
        elif f0 == 0:
            t_in = shared_t[:, -nf:]
        else:
            t_in = shared_t[:, :nf]
        x0 = denoise(x_in, t_in, f0 * T, False)
        if guided:
            x0_neg = denoise(x_in, t_in, f0 * T, False, 1).float()
            frame_sigma = sigmas[_nearest(timesteps, t_in[0])]
            s = torch.where(frame_sigma > guidance_sigma_min, guidance_scale, 1.0).view(1, -1, 1, 1, 1)
            x0 = (x0_neg + s * (x0.float() - x0_neg)).to(x0.dtype)
        output[:, f0:f1] = x0
        for b in range(sb, eb + 1):
            bt = t_in[:, (b - sb) * fpb : (b - sb + 1) * fpb].mean().item()
            idx = int(torch.nonzero((steps - bt).abs() < 1e-4)[0, 0])
            if idx == nsteps - 1:
                continue
            nxt = steps[idx + 1]
            flat = x0.flatten(0, 1)
            eps = torch.randn(flat.shape, generator=generator, dtype=flat.dtype)
            sigma = sigmas[_nearest(timesteps, nxt.reshape(1))].reshape(1, 1, 1, 1)
            renoised = ((1 - sigma) * flat + sigma * eps).type_as(eps).unflatten(0, x0.shape[:2])
            noisy[:, b * fpb : (b + 1) * fpb] = renoised[:, (b - sb) * fpb : (b - sb + 1) * fpb]
        for i in range(len(states)):
            denoise(x0[:, :fpb], torch.zeros(bsz, fpb), f0 * T, True, i)
    return output


__all__ = ["rolling_forcing_reference"]
