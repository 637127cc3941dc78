"""Wan2.1 causal DiT (the Rolling Forcing / Self-Forcing ``CausalWanModel``) in PyTorch.

The parameter names (``state_dict()`` keys) are exactly those of the original Wan2.1 ``WanModel``:
``patch_embedding``, ``text_embedding.{0,2}``, ``time_embedding.{0,2}``, ``time_projection.1``,
``blocks.{i}.{modulation, self_attn.{q,k,v,o,norm_q,norm_k}, norm3, cross_attn.{q,k,v,o,norm_q,norm_k},
ffn.{0,2}}``, ``head.head``, ``head.modulation``.

RoPE and attention go only through :mod:`nki_kernels.ops`. The self-attention *key set* is not the
model's business: :meth:`CausalWanModel.forward_with` hands each layer's normalised, un-roped
``q, k, v`` ``[B, L, H, D]`` to a caller-supplied :data:`SelfAttnFn`, which ropes them, reads/writes the KV
cache and returns the attention output. The streaming pipeline, the reference loop and
:meth:`CausalWanModel.forward_full` each supply their own.

Precision follows the causal repos: modulation and residual arithmetic in the activation dtype,
RMSNorm in fp32, sinusoidal time embedding in float64, flow -> x0 conversion in float64.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from nki_kernels import ops
from rolling_forcing.config import ModelConfig

Grid = tuple[int, int, int]
SelfAttnFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, Grid], torch.Tensor]
"""``fn(layer, q, k, v, grid) -> out``: q, k RMS-normalised but un-roped, all ``[B, L, H, D]``
(L = F*Hp*Wp, tokens in (f, h, w) order); returns the attention output ``[B, L, H, D]``."""

TextKV = list[tuple[torch.Tensor, torch.Tensor]]
"""Per-layer cross-attention ``(k, v)``, each ``[B, text_len, H, D]`` (the text k/v cache)."""


def sinusoidal_embedding_1d(dim: int, position: torch.Tensor) -> torch.Tensor:
    """Wan's timestep embedding in float64: ``[cos(t w_k), sin(t w_k)]``, w_k = 10000^(-k/(dim/2)).

    ``position`` ``[N]`` (any float dtype, raw flow-matching timesteps); returns float64 ``[N, dim]``.
    """
    half = dim // 2
    pos = position.to(torch.float64)
    sinusoid = torch.outer(pos, torch.pow(10000, -torch.arange(half, dtype=torch.float64).div(half)))
    return torch.cat([torch.cos(sinusoid), torch.sin(sinusoid)], dim=1)


class RMSNorm(nn.Module):
    """Wan's RMSNorm over the full vector, computed in fp32, learnable weight ``[dim]``."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return y.type_as(x) * self.weight


class LayerNorm(nn.LayerNorm):
    """LayerNorm returning the input dtype (Wan's ``WanLayerNorm``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).type_as(x)


class Attention(nn.Module):
    """Projections of Wan's self/cross attention: q, k, v, o (with bias) and RMSNorm on q and k."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)
        self.norm_q = RMSNorm(dim, eps)
        self.norm_k = RMSNorm(dim, eps)


class WanBlock(nn.Module):
    """One causal Wan attention block (adaLN self-attention, cross-attention, FFN)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = cfg.dim
        self.num_heads = cfg.num_heads
        self.norm1 = LayerNorm(d, eps=cfg.eps, elementwise_affine=False)
        self.self_attn = Attention(d, cfg.eps)
        self.norm3 = LayerNorm(d, eps=cfg.eps, elementwise_affine=True)
        self.cross_attn = Attention(d, cfg.eps)
        self.norm2 = LayerNorm(d, eps=cfg.eps, elementwise_affine=False)
        self.ffn = nn.Sequential(
            nn.Linear(d, cfg.ffn_dim), nn.GELU(approximate="tanh"), nn.Linear(cfg.ffn_dim, d)
        )
        self.modulation = nn.Parameter(torch.randn(1, 6, d) / d**0.5)

    def forward(
        self,
        layer: int,
        x: torch.Tensor,
        e0: torch.Tensor,
        grid: Grid,
        text_kv: tuple[torch.Tensor, torch.Tensor],
        self_attn: SelfAttnFn,
        backend: str | None,
        drop_frames: int = 0,
    ) -> torch.Tensor:
        """x ``[B, L, dim]``; e0 ``[B, F, 6, dim]`` per-frame modulation; returns ``[B, L', dim]``.

        ``drop_frames`` (static int, 0 <= drop_frames <= F): the leading frames whose output is not
        needed (the last layer of a pass whose first frames only write the KV cache). Their k/v are still
        computed and handed to ``self_attn`` (it writes them), but they get no query, no attention output,
        no output projection, cross-attention or FFN; the block returns only the other
        ``L' = L - drop_frames * L/F`` tokens, and ``self_attn`` receives q ``[B, L', H, D]`` (the last L'
        tokens) with k, v ``[B, L, H, D]``.
        """
        b, seq, dim = x.shape
        f = grid[0]
        h = self.num_heads
        if not 0 <= drop_frames <= f:
            raise ValueError(f"drop_frames must be in [0, F={f}], got {drop_frames}")
        tpf = seq // f
        mod = self.modulation.unsqueeze(1) + e0  # [B, F, 6, dim]
        shift_sa, scale_sa = mod[:, :, 0:1], mod[:, :, 1:2]

        def modulate(y: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            return (y.unflatten(1, (-1, tpf)) * (1 + scale) + shift).flatten(1, 2)

        def gated(y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
            return (y.unflatten(1, (-1, tpf)) * gate).flatten(1, 2)

        sa = self.self_attn
        xm = modulate(self.norm1(x), shift_sa, scale_sa)
        n0 = drop_frames * tpf
        xq = xm[:, n0:] if n0 else xm
        q = sa.norm_q(sa.q(xq)).view(b, seq - n0, h, dim // h)
        k = sa.norm_k(sa.k(xm)).view(b, seq, h, dim // h)
        v = sa.v(xm).view(b, seq, h, dim // h)
        y = self_attn(layer, q, k, v, grid)
        if n0:  # the dropped frames' outputs are never read: stop here for them
            x, mod = x[:, n0:], mod[:, drop_frames:]
            if n0 == seq:
                return x
        gate_sa, shift_ff, scale_ff, gate_ff = (mod[:, :, i : i + 1] for i in range(2, 6))
        x = x + gated(sa.o(y.flatten(2)), gate_sa)

        ca = self.cross_attn
        qc = ca.norm_q(ca.q(self.norm3(x))).view(b, seq - n0, h, dim // h)
        tk, tv = text_kv
        yc = ops.attention(qc, tk, tv, backend=backend)
        assert isinstance(yc, torch.Tensor)
        x = x + ca.o(yc.flatten(2))

        yf = self.ffn(modulate(self.norm2(x), shift_ff, scale_ff))
        return x + gated(yf, gate_ff)


class Head(nn.Module):
    """Output head: LayerNorm (no affine), 2-way modulation by the time embedding, Linear."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm = LayerNorm(cfg.dim, eps=cfg.eps, elementwise_affine=False)
        self.head = nn.Linear(cfg.dim, cfg.patch_out)
        self.modulation = nn.Parameter(torch.randn(1, 2, cfg.dim) / cfg.dim**0.5)

    def forward(self, x: torch.Tensor, e: torch.Tensor, frames: int) -> torch.Tensor:
        """x ``[B, L, dim]``, e ``[B, F, 1, dim]`` -> ``[B, F, L/F, patch_out]``."""
        shift, scale = (self.modulation.unsqueeze(1) + e).chunk(2, dim=2)
        return self.head(self.norm(x).unflatten(1, (frames, x.shape[1] // frames)) * (1 + scale) + shift)


class CausalWanModel(nn.Module):
    """Wan2.1 causal DiT with per-frame timesteps (see the module docstring).

    Args:
        cfg: model hyper-parameters (e.g. ``get_preset("wan2.1-1.3b")`` or ``get_preset("tiny")``).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.dim
        self.patch_embedding = nn.Conv3d(
            cfg.in_channels, d, kernel_size=cfg.patch_size, stride=cfg.patch_size
        )
        self.text_embedding = nn.Sequential(
            nn.Linear(cfg.text_dim, d), nn.GELU(approximate="tanh"), nn.Linear(d, d)
        )
        self.time_embedding = nn.Sequential(nn.Linear(cfg.freq_dim, d), nn.SiLU(), nn.Linear(d, d))
        self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(d, 6 * d))
        self.blocks = nn.ModuleList([WanBlock(cfg) for _ in range(cfg.num_layers)])
        self.head = Head(cfg)

    # ---- weights -------------------------------------------------------------------------------
    @torch.no_grad()
    def init_random(self, seed: int = 0) -> CausalWanModel:
        """Seeded non-trivial random weights for tests (no zeros, norms perturbed around 1); returns self."""
        g = torch.Generator().manual_seed(seed)
        for name, p in sorted(self.named_parameters()):
            r = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if name.endswith("modulation"):
                val = r / self.cfg.dim**0.5
            elif "norm" in name and name.endswith("weight"):
                val = 1 + 0.1 * r
            elif p.dim() >= 2:
                fan_in = p[0].numel()
                val = r / fan_in**0.5
            else:
                val = 0.05 * r
            p.copy_(val.to(p.dtype))
        return self

    # ---- text ----------------------------------------------------------------------------------
    def check_context(self, context: torch.Tensor) -> None:
        """Raise ``TypeError``/``ValueError`` unless ``context`` is text embeddings ``[B, 1..text_len,
        text_dim]`` (a prompt, before :meth:`embed_text`)."""
        c = self.cfg
        if not isinstance(context, torch.Tensor):
            raise TypeError(f"text embeddings must be a torch.Tensor, got {type(context).__name__}")
        if context.dim() != 3 or context.shape[2] != c.text_dim or not 1 <= context.shape[1] <= c.text_len:
            raise ValueError(
                f"text embeddings must be [B, L, text_dim] with text_dim={c.text_dim} and 1 <= L <= "
                f"text_len={c.text_len} (shorter prompts are zero-padded), got {tuple(context.shape)}"
            )

    def embed_text(self, context: torch.Tensor) -> torch.Tensor:
        """Zero-pad ``[B, L<=text_len, text_dim]`` to text_len; text_embedding -> ``[B, text_len, dim]``."""
        self.check_context(context)
        pad = self.cfg.text_len - context.shape[1]
        if pad:
            context = torch.cat([context, context.new_zeros(context.shape[0], pad, context.shape[2])], dim=1)
        return self.text_embedding(context.to(self.patch_embedding.weight.dtype))

    def text_kv(self, context: torch.Tensor) -> TextKV:
        """Per-layer cross-attention k/v of a prompt (the text k/v cache), each ``[B, text_len, H, D]``."""
        ctx = self.embed_text(context)
        b, lt, d = ctx.shape
        h = self.cfg.num_heads
        out = []
        for blk in self.blocks:
            assert isinstance(blk, WanBlock)
            ca = blk.cross_attn
            k = ca.norm_k(ca.k(ctx)).view(b, lt, h, d // h)
            v = ca.v(ctx).view(b, lt, h, d // h)
            out.append((k, v))
        return out

    # ---- forwards ------------------------------------------------------------------------------
    def check_latents(self, x: torch.Tensor, name: str, frames_dim: int) -> None:
        """Raise ``TypeError``/``ValueError`` naming ``name`` unless ``x`` is latents of this model:
        ``[B, F, C, H, W]`` (``frames_dim=1``) or ``[B, C, F, H, W]`` (``frames_dim=2``)."""
        c = self.cfg
        chw = (c.in_channels, c.latent_height, c.latent_width)
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        got = tuple(x.shape[2:]) if frames_dim == 1 else (x.shape[1], *x.shape[3:])
        if x.dim() != 5 or got != chw:
            layout = "[B, F, C, H, W]" if frames_dim == 1 else "[B, C, F, H, W]"
            raise ValueError(f"{name} must be {layout} with (C, H, W) = {chw}, got {tuple(x.shape)}")

    def check_forward_inputs(self, x: torch.Tensor, timesteps: torch.Tensor, context_frames: int) -> Grid:
        """Validate the inputs of a forward (:meth:`forward_with`, or a sharded forward built from the
        same pieces) and return the token grid ``(F, Hp, Wp)`` of ``x``.

        Raises ``TypeError``/``ValueError`` naming the argument: ``x`` not ``[B, F, C, H, W]`` latents,
        ``timesteps`` not ``[B, F]``, ``context_frames`` not an int in ``[0, F]``.
        """
        self.check_latents(x, "x", 1)
        b, f = x.shape[:2]
        if tuple(timesteps.shape) != (b, f):
            raise ValueError(f"timesteps must be [B, F] = {(b, f)}, got {tuple(timesteps.shape)}")
        if isinstance(context_frames, bool) or not isinstance(context_frames, int):
            raise TypeError(f"context_frames must be an int, got {type(context_frames).__name__}")
        if not 0 <= context_frames <= f:
            raise ValueError(f"context_frames must be in [0, F={f}], got {context_frames}")
        hp, wp = self.cfg.grid_hw
        return (f, hp, wp)

    def embed(
        self, x: torch.Tensor, timesteps: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Patch and time embeddings of checked inputs (:meth:`check_forward_inputs`).

        Returns ``(tok, e, e0)`` in the weights' dtype: the tokens ``[B, L, dim]`` (L = F*Hp*Wp, (f, h, w)
        order), the time embedding ``[B*F, dim]`` (the head's modulation input) and the blocks' per-frame
        modulation ``[B, F, 6, dim]``.
        """
        c = self.cfg
        b, f = x.shape[:2]
        dtype = self.patch_embedding.weight.dtype
        tok = self.patch_embedding(x.permute(0, 2, 1, 3, 4).to(dtype)).flatten(2).transpose(1, 2)
        e = self.time_embedding(sinusoidal_embedding_1d(c.freq_dim, timesteps.flatten()).to(dtype))
        e0 = self.time_projection(e).unflatten(1, (6, c.dim)).unflatten(0, (b, f))
        return tok, e, e0

    def unpatchify(self, out: torch.Tensor, frames: int) -> torch.Tensor:
        """Head output of ``frames`` frames (``[B, frames*Hp*Wp, patch_out]`` or ``[B, frames, Hp*Wp,
        patch_out]``, tokens in (f, h, w) order) -> latents ``[B, frames, C, H, W]`` (out's dtype)."""
        c = self.cfg
        hp, wp = c.grid_hw
        _, ph, pw = c.patch_size
        b = out.shape[0]
        out = out.reshape(b, frames, hp, wp, ph, pw, c.out_channels)
        return torch.einsum("bfhwpqc->bfchpwq", out).reshape(b, frames, c.out_channels, hp * ph, wp * pw)

    def forward_with(
        self,
        x: torch.Tensor,
        timesteps: torch.Tensor,
        text_kv: TextKV,
        self_attn: SelfAttnFn,
        *,
        backend: str | None = None,
        context_frames: int = 0,
    ) -> torch.Tensor:
        """Flow prediction of latents with per-frame timesteps and a caller-defined self-attention.

        Args:
            x: latents ``[B, F, C, H, W]`` (frames on dim 1, as the pipeline stores them).
            timesteps: ``[B, F]`` raw flow-matching timesteps (float32 values like 952.38).
            text_kv: from :meth:`text_kv`.
            self_attn: see :data:`SelfAttnFn`. In the last layer it receives q of the output frames only
                (``[B, (F - context_frames)*Hp*Wp, H, D]``, the last tokens) with k, v of all frames.
            backend: ``nki_kernels.ops`` backend of the cross-attention.
            context_frames: static int in ``[0, F]``: the leading frames that only feed the KV cache (a
                cache-update block). Every layer computes their k/v (``self_attn`` writes them); in the last
                layer they stop there (no query, attention, output projection, cross-attention, FFN), and
                the head skips them. With ``context_frames == F`` nothing is returned but the writes.

        Returns:
            the flow (velocity ``eps - x0``) prediction ``[B, F - context_frames, C, H, W]`` of the frames
            after the context frames, in x's dtype.
        """
        grid = self.check_forward_inputs(x, timesteps, context_frames)
        b, f = x.shape[:2]
        tok, e, e0 = self.embed(x, timesteps)
        last = len(self.blocks) - 1
        for i, blk in enumerate(self.blocks):
            drop = context_frames if i == last else 0
            tok = blk(i, tok, e0, grid, text_kv[i], self_attn, backend, drop)
        fo = f - context_frames
        if fo == 0:
            return x.new_empty((b, 0, *x.shape[2:]))
        e_out = e.unflatten(0, (b, f))[:, context_frames:].unsqueeze(2)
        out = self.head(tok, e_out, fo)  # [B, F', Hp*Wp, patch_out]
        return self.unpatchify(out, fo).to(x.dtype)

    def forward_full(
        self,
        latents: torch.Tensor,
        timestep: torch.Tensor,
        context: torch.Tensor,
        *,
        backend: str | None = None,
    ) -> torch.Tensor:
        """Plain single-pass forward (non-causal, like Wan's ``WanModel``) for equivalence tests.

        Args:
            latents: ``[B, C, F, H, W]``.
            timestep: ``[B]``, one timestep per sample (uniform over frames).
            context: text embeddings ``[B, L<=text_len, text_dim]``.

        Returns:
            flow prediction ``[B, C, F, H, W]``; full attention over all tokens, RoPE from frame 0.
        """
        self.check_latents(latents, "latents", 2)
        b, f = latents.shape[0], latents.shape[2]
        if timestep.dim() != 1 or timestep.shape[0] != b:
            raise ValueError(f"timestep must be [B] = [{b}], got {tuple(timestep.shape)}")

        # RoPE tables once per forward (every layer shares them); float64: the reference stays exact
        hp, wp = self.cfg.grid_hw
        cos, sin = ops.rope_tables(
            (f, hp, wp), self.cfg.head_dim, 0, dtype=torch.float64, device=latents.device
        )

        def full_attn(
            layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: Grid
        ) -> torch.Tensor:
            qr, kr = ops.rope3d_tables(q, k, cos, sin, backend=backend)
            out = ops.attention(qr, kr, v, backend=backend)
            assert isinstance(out, torch.Tensor)
            return out

        t = timestep.to(torch.float32)[:, None].expand(b, f)
        flow = self.forward_with(
            latents.transpose(1, 2), t, self.text_kv(context), full_attn, backend=backend
        )
        return flow.transpose(1, 2)


def flow_to_x0(
    flow: torch.Tensor, x_t: torch.Tensor, timesteps: torch.Tensor, table: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """``x0 = x_t - sigma_t * flow`` in float64, sigma at the scheduler's nearest timestep.

    Args:
        flow, x_t: ``[B, F, C, H, W]``.
        timesteps: ``[B, F]``.
        table: ``(sigmas, timesteps)`` of the scheduler (``PipelineConfig.scheduler_table()``).

    Returns:
        x0 in flow's dtype.
    """
    sig, ts = (t.double().to(flow.device) for t in table)
    idx = torch.argmin((ts[None, :] - timesteps.flatten().double()[:, None]).abs(), dim=1)
    sigma = sig[idx].view(*timesteps.shape, 1, 1, 1)
    return (x_t.double() - sigma * flow.double()).to(flow.dtype)


def add_noise(
    x0: torch.Tensor, noise: torch.Tensor, timestep: float, table: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """Forward process ``(1 - sigma) x0 + sigma noise`` with sigma at the nearest scheduler timestep.

    Same arithmetic as the original's ``FlowMatchScheduler.add_noise`` (float32 sigma, result cast to
    noise's dtype).
    """
    sig, ts = table
    idx = int(torch.argmin((ts - torch.tensor(timestep, dtype=torch.float32)).abs()))
    sigma = sig[idx].to(x0.device)
    return ((1 - sigma) * x0 + sigma * noise).type_as(noise)


def param_count(model: nn.Module, names: Sequence[str] | None = None) -> int:
    """Number of parameters (all, or those whose name starts with one of ``names``)."""
    return sum(p.numel() for n, p in model.named_parameters() if names is None or n.startswith(tuple(names)))


__all__ = [
    "CausalWanModel",
    "SelfAttnFn",
    "TextKV",
    "add_noise",
    "flow_to_x0",
    "param_count",
    "sinusoidal_embedding_1d",
]
