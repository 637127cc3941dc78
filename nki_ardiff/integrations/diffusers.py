"""The project's RoPE and attention ops inside diffusers' ``WanTransformer3DModel`` (an attention processor).

One call installs it on every attention module of a model::

    from nki_ardiff.integrations.diffusers import install_nki_attention

    install_nki_attention(transformer, backend="emulator")  # or "reference", "neuron", None

Each ``WanAttention`` module then runs, in place of diffusers' ``WanAttnProcessor``:

* **self-attention** (``attn1``): diffusers' projections and q/k RMSNorm (the module's own layers,
  untouched), then :func:`nki_kernels.ops.rope3d_tables` with the rotary tables the model's ``rope``
  module passed in (so the positions are the model's own, including any offset a subclass puts in them),
  then :func:`nki_kernels.ops.attention`, then the module's output projection;
* **cross-attention** (``attn2``): the same projections and norms, then :func:`nki_kernels.ops.attention`
  over the text tokens.

Layouts: the ops read and write ``[B, L, H, D]`` (tokens on dim 1, heads on dim 2), which is the layout
diffusers' Wan processor already uses after ``unflatten(2, (heads, -1))``; nothing is transposed. The
tables are diffusers' ``(cos, sin)`` pair, each ``[1, L, 1, D]`` with every frequency repeated for the two
members of a pair; the processor passes columns ``0::2`` of cos and ``1::2`` of sin (``[L, D/2]``, the same
numbers diffusers' processor multiplies with) to the op.

Limits (each refused with an error that names the module, at install time where it can be known then,
never by a silent fallback to diffusers' attention):

* no attention mask (``attention_mask`` must be None: the ops have no mask);
* no image cross-attention (Wan I2V / FLF2V: ``add_k_proj``), no key/value head size other than the query's
  (``cross_attention_dim_head``), no attention module other than ``WanAttention``;
* no diffusers attention backend or context-parallel config set on the processor afterwards
  (``set_attention_backend``, ``enable_parallelism``): those would be ignored, so they are refused;
* activations bf16 or fp32 (the ops' dtypes); head_dim <= 128 on the kernel backends (emulator, neuron);
* inference: ``ops.rope3d_tables`` has no backward (a backward through the self-attention raises
  ``RuntimeError`` naming ``nki_ardiff.rope3d_tables``); ``ops.attention`` has one.

Under ``torch.compile(fullgraph=True)`` the processor traces into one graph with the ops as custom-op
nodes (tested with a counting backend). The backend rule is the ops' one: ``backend=None`` reads
``$NKI_ARDIFF_BACKEND`` when each op runs, an explicit name is checked at install.

Tested against diffusers 0.42.1 and 0.36.0 (``tests/test_integrations_diffusers.py``; the extras pin
``diffusers>=0.36,<0.43``, see ``docs/integrate.md``). Releases before 0.35, whose Wan processor took a
complex rotary tensor, are refused at the first call (the rotary check below); 0.35.x passes tables whose
angles differ from Wan's for a head_dim that is not a multiple of 6 (diffusers' own angles, followed as
given).
"""

from __future__ import annotations

from typing import Any

import torch

from nki_kernels import ops

ACT_DTYPES = (torch.bfloat16, torch.float32)
"""Activation dtypes the ops take."""

KERNEL_MAX_HEAD_DIM = 128
"""head_dim limit of the kernel backends (D lives on the 128 partitions); the reference backend has none."""

_KERNEL_BACKENDS = ("emulator", "neuron")


class NkiWanAttnProcessor:
    """Attention processor for one diffusers ``WanAttention`` module (see the module docstring).

    Args:
        name: the module's qualified name in its model (``"blocks.3.attn1"``); every error names it.
        backend: ``nki_kernels.ops`` backend of every op call (``None``: ``$NKI_ARDIFF_BACKEND`` at call
            time, else ``"reference"``). Checked here when given.

    Call signature (diffusers' processor protocol): ``processor(attn, hidden_states,
    encoder_hidden_states=None, attention_mask=None, rotary_emb=None)`` with ``hidden_states`` ``[B, L,
    dim]``, ``encoder_hidden_states`` ``[B, Lt, dim]`` (cross-attention) and ``rotary_emb`` diffusers'
    ``(cos, sin)``, each ``[1, L, 1, D]`` (self-attention); returns ``[B, L, dim]`` in hidden_states' dtype.
    """

    # diffusers writes these two attributes on a module's processor (``set_attention_backend``,
    # context parallelism); they are read at every call and refused when set
    _attention_backend: Any = None
    _parallel_config: Any = None

    def __init__(self, name: str, backend: str | None = None) -> None:
        if not isinstance(name, str) or not name:
            raise TypeError(f"name must be the module's qualified name (a non-empty str), got {name!r}")
        if backend is not None:
            ops.resolve_backend(backend)  # ValueError naming backend, RuntimeError for neuron without nki
        self.name = name
        self.backend = backend

    def __repr__(self) -> str:
        return f"NkiWanAttnProcessor(name={self.name!r}, backend={self.backend!r})"

    def _refuse(self, what: str) -> ValueError:
        return ValueError(f"{self.name}: {what} (NkiWanAttnProcessor, nki_ardiff.integrations.diffusers)")

    def _check_call(
        self,
        attn: torch.nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        kwargs: dict[str, Any],
    ) -> None:
        if kwargs:
            raise TypeError(
                f"{self.name}: unexpected processor argument(s) {sorted(kwargs)}; NkiWanAttnProcessor takes "
                "hidden_states, encoder_hidden_states, attention_mask (None) and rotary_emb"
            )
        if attention_mask is not None:
            raise self._refuse(
                "attention_mask is not supported (the project's attention op has no mask); pass None"
            )
        if self._attention_backend is not None:
            raise self._refuse(
                f"a diffusers attention backend ({self._attention_backend}) was set on this processor; it "
                "would be ignored: choose the kernels with install_nki_attention(backend=...) instead"
            )
        if self._parallel_config is not None:
            raise self._refuse("diffusers context parallelism is not supported by this processor")
        _check_module(self.name, attn, self.backend)
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 3:
            raise ValueError(
                f"{self.name}: hidden_states must be a [B, L, dim] tensor, got "
                f"{tuple(hidden_states.shape) if isinstance(hidden_states, torch.Tensor) else hidden_states}"
            )
        if hidden_states.dtype not in ACT_DTYPES:
            raise TypeError(
                f"{self.name}: hidden_states dtype {hidden_states.dtype} is not supported; the ops take "
                f"{ACT_DTYPES[0]} or {ACT_DTYPES[1]} (cast the model, e.g. transformer.to(torch.bfloat16))"
            )
        if encoder_hidden_states is not None and (
            not isinstance(encoder_hidden_states, torch.Tensor)
            or encoder_hidden_states.dim() != 3
            or encoder_hidden_states.shape[0] != hidden_states.shape[0]
        ):
            raise ValueError(
                f"{self.name}: encoder_hidden_states must be [B, Lt, dim] with hidden_states' batch "
                f"B={hidden_states.shape[0]}"
            )

    def _tables(
        self, rotary_emb: Any, tokens: int, head_dim: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """diffusers' ``(cos, sin)`` ``[1, L, 1, D]`` -> the op's ``[L, D/2]`` tables (fp32 or fp64)."""
        want = (1, tokens, 1, head_dim)
        if (
            not isinstance(rotary_emb, (tuple, list))
            or len(rotary_emb) != 2
            or not all(isinstance(t, torch.Tensor) for t in rotary_emb)
            or any(tuple(t.shape) != want or t.is_complex() for t in rotary_emb)
        ):
            got = (
                [(tuple(t.shape), t.dtype) for t in rotary_emb if isinstance(t, torch.Tensor)]
                if isinstance(rotary_emb, (tuple, list))
                else type(rotary_emb).__name__
            )
            raise self._refuse(
                f"rotary_emb must be diffusers' (cos, sin) pair of real tensors [1, L, 1, D] = {list(want)} "
                f"(WanRotaryPosEmbed of diffusers >= 0.35), got {got}"
            )
        cos, sin = rotary_emb[0][0, :, 0, 0::2], rotary_emb[1][0, :, 0, 1::2]
        if cos.dtype not in ops.TABLE_DTYPES:  # a model cast with .to(bf16) also casts its rope buffers
            cos, sin = cos.float(), sin.float()
        if cos.device != device:
            raise self._refuse(f"rotary_emb is on {cos.device} but the activations are on {device}")
        return cos.contiguous(), sin.contiguous()

    def __call__(
        self,
        attn: torch.nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        self._check_call(attn, hidden_states, encoder_hidden_states, attention_mask, kwargs)
        cross = encoder_hidden_states is not None
        if cross and rotary_emb is not None:
            raise self._refuse(
                "rotary_emb was passed to a cross-attention call (Wan ropes self-attention only)"
            )
        a: Any = attn
        heads = int(a.heads)
        tables = None
        if rotary_emb is not None:  # checked before any projection runs
            head_dim = int(a.inner_dim) // heads
            tables = self._tables(rotary_emb, hidden_states.shape[1], head_dim, hidden_states.device)
        src = encoder_hidden_states if encoder_hidden_states is not None else hidden_states
        if getattr(a, "fused_projections", False):
            if a.is_cross_attention:  # diffusers' rule: the module's kind picks the fused weight
                q = a.to_q(hidden_states)
                k, v = a.to_kv(src).chunk(2, dim=-1)
            else:
                q, k, v = a.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            q, k, v = a.to_q(hidden_states), a.to_k(src), a.to_v(src)
        q = a.norm_q(q).unflatten(2, (heads, -1)).contiguous()
        k = a.norm_k(k).unflatten(2, (heads, -1)).contiguous()
        v = v.unflatten(2, (heads, -1)).contiguous()
        if tables is not None:
            q, k = ops.rope3d_tables(q, k, *tables, backend=self.backend)
        out = ops.attention(q, k, v, backend=self.backend)
        assert isinstance(out, torch.Tensor)
        out = a.to_out[0](out.flatten(2, 3))
        return a.to_out[1](out)


def _check_module(name: str, attn: torch.nn.Module, backend: str | None) -> None:
    """Refuse an attention module the processor cannot serve (ValueError naming ``name``)."""
    where = f"{name} ({type(attn).__name__})"
    a: Any = attn
    if getattr(a, "add_k_proj", None) is not None or getattr(a, "added_kv_proj_dim", None) is not None:
        raise ValueError(
            f"{where}: image cross-attention (add_k_proj, Wan I2V/FLF2V) is not supported by "
            "NkiWanAttnProcessor; only text-to-video Wan attention is"
        )
    for attr in ("to_q", "to_out", "norm_q", "norm_k", "heads", "inner_dim"):
        if not hasattr(a, attr):
            raise ValueError(f"{where}: not a diffusers WanAttention (no attribute {attr!r})")
    inner, kv_inner = getattr(a, "inner_dim", None), getattr(a, "kv_inner_dim", None)
    if inner is not None and kv_inner is not None and inner != kv_inner:
        raise ValueError(
            f"{where}: key/value width {kv_inner} != query width {inner} (cross_attention_dim_head differs "
            "from the query head size); the attention op needs one head_dim"
        )
    if backend in _KERNEL_BACKENDS and inner is not None and inner // int(a.heads) > KERNEL_MAX_HEAD_DIM:
        raise ValueError(
            f"{where}: head_dim {inner // int(a.heads)} > {KERNEL_MAX_HEAD_DIM}, the kernel backends' limit "
            f"(backend={backend!r}); use backend='reference'"
        )


def install_nki_attention(
    model: torch.nn.Module, *, backend: str | None = None
) -> dict[str, NkiWanAttnProcessor]:
    """Install :class:`NkiWanAttnProcessor` on every attention module of a diffusers Wan model.

    Args:
        model: a diffusers ``WanTransformer3DModel`` (or any module whose attention modules are diffusers
            ``WanAttention``: one block, a subclass). Its weights, dtype and device are not touched.
        backend: ``nki_kernels.ops`` backend (``"reference"``, ``"emulator"``, ``"neuron"`` or None =
            ``$NKI_ARDIFF_BACKEND`` at call time); an explicit name is checked now.

    Returns:
        ``{module name: processor}`` of what was installed (one processor per module, each naming its
        module in its errors).

    Every attention module is checked before any is changed (all or nothing): ``TypeError`` when
    ``model`` is not a module, ``ValueError`` naming the module when one is not a ``WanAttention``, has
    image cross-attention (I2V), a key/value head size other than the query's or, on a kernel backend,
    head_dim > 128; ``ValueError`` when the model has no attention module at all. diffusers' own processor
    comes back with ``model.set_attn_processor(WanAttnProcessor())``.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"model must be a torch.nn.Module (a WanTransformer3DModel), got {type(model).__name__}"
        )
    if backend is not None:
        ops.resolve_backend(backend)
    try:
        from diffusers.models.transformers.transformer_wan import WanAttention
    except ImportError as exc:  # pragma: no cover - the test extra installs diffusers
        raise ImportError(
            "install_nki_attention needs diffusers (pip install -e '.[hf]'): " + str(exc)
        ) from exc
    targets: list[tuple[str, torch.nn.Module]] = []
    for name, mod in model.named_modules():
        if not hasattr(mod, "set_processor"):
            continue
        label = name or type(model).__name__
        if not isinstance(mod, WanAttention):
            raise ValueError(
                f"{label} ({type(mod).__name__}): only diffusers WanAttention modules are supported by "
                "NkiWanAttnProcessor; nothing was installed"
            )
        _check_module(label, mod, backend)
        targets.append((label, mod))
    if not targets:
        raise ValueError(
            f"model ({type(model).__name__}) has no diffusers WanAttention module to install the processor on"
        )
    installed: dict[str, NkiWanAttnProcessor] = {}
    for label, mod in targets:
        proc = NkiWanAttnProcessor(label, backend)
        mod.set_processor(proc)  # type: ignore[operator]
        installed[label] = proc
    return installed


__all__ = ["ACT_DTYPES", "KERNEL_MAX_HEAD_DIM", "NkiWanAttnProcessor", "install_nki_attention"]
