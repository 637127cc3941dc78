"""Your model, our stream: a diffusers-format causal Wan checkpoint through the project's stream driver.

A causal Wan DiT (Self-Forcing, CausVid, Rolling Forcing, LongLive weights) saved in diffusers' layout, as
a ``WanTransformer3DModel`` in memory or its ``save_pretrained`` directory, runs through
:class:`rolling_forcing.pipeline.RollingForcingPipeline`: every method of :mod:`rolling_forcing.methods`,
the ring KV cache read in place, block-table attention, the merged static-shape forward and
``torch.compile`` (see ``docs/integrate.md``)::

    from nki_ardiff.integrations.diffusers_stream import stream_from_diffusers

    pipe = stream_from_diffusers(transformer, latent_size=(60, 104))  # a RollingForcingPipeline
    for chunk in pipe.stream(text_embeds, num_blocks=8):
        ...  # chunk.latents [B, 3, 16, 60, 104]

How: the diffusers config becomes a :class:`rolling_forcing.config.ModelConfig`
(:func:`model_config_from_diffusers`) and the weights are renamed to the Wan names of
:class:`rolling_forcing.model.CausalWanModel` (:func:`rolling_forcing.checkpoint.diffusers_to_wan`, a pure
renaming). From a model in memory the project's model **shares** its parameters (the same tensors, no
copy: 1.3B parameters are not held twice, and an in-place change of the diffusers weights is seen by the
stream); from a directory the weights are read once. The forward is then the project's own
(``CausalWanModel.forward_with``: per-frame timesteps, float64 time sinusoid, the ops), so the stream is
the one the project's model gives on the same weights, bit for bit
(``tests/test_integrations_diffusers_stream.py``).

diffusers' own forward and the attention processor of :mod:`nki_ardiff.integrations.diffusers` are not
used here: diffusers' ``WanTransformer3DModel`` (0.42.1, the tested release) has no KV cache and takes one
timestep per sample, while the stream needs per-frame timesteps and attention over a rolling cache.

Refused (``ValueError`` naming the config field or parameter): image-to-video and other variants
(``image_dim``, ``added_kv_proj_dim``, ``pos_embed_seq_len``, no affine cross-attention norm), a
patch size with more than one frame per token, parameters that have no Wan name (a PEFT adapter not fused,
fused q/k/v projections), parameters of several dtypes or devices (a model loaded with
``torch_dtype=bfloat16`` keeps some in fp32: cast it with ``.to(dtype)`` first), a dtype other than the
stream's (``pipe_cfg.dtype``), and anything diffusers' forward would run that the stream's would not
(diffusers hooks such as ``enable_cache`` or offloading, a custom attention processor, a diffusers
attention backend: ``ValueError`` naming the module). Diffusers' ``WanAttnProcessor`` and the project's
``NkiWanAttnProcessor`` are both accepted: the stream attends with the project's ops either way.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from nki_kernels import ops
from rolling_forcing.checkpoint import (
    CheckpointError,
    check_tensors,
    compare_keys,
    diffusers_to_wan,
    load_checkpoint,
)
from rolling_forcing.config import ModelConfig, PipelineConfig
from rolling_forcing.merged import CompileSpec
from rolling_forcing.methods import StreamMethod, get_method
from rolling_forcing.model import CausalWanModel
from rolling_forcing.pipeline import RollingForcingPipeline

WAN_TEXT_LEN = 512
"""Text tokens of Wan2.1's umT5 context (prompts are zero-padded to it, as diffusers' Wan pipelines do)."""

_UNSUPPORTED = {
    "image_dim": "image-to-video (an image embedder)",
    "added_kv_proj_dim": "image cross-attention (add_k_proj / add_v_proj)",
    "pos_embed_seq_len": "a positional embedding of the image context (FLF2V)",
}


def _int_pair(name: str, value: Any) -> tuple[int, int]:
    if (
        not isinstance(value, (tuple, list))
        or len(value) != 2
        or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in value)
    ):
        raise ValueError(f"{name} must be (latent_height, latent_width), two ints >= 1, got {value!r}")
    return int(value[0]), int(value[1])


def model_config_from_diffusers(
    config: Mapping[str, Any],
    *,
    latent_size: tuple[int, int],
    text_len: int = WAN_TEXT_LEN,
    name: str = "diffusers",
) -> ModelConfig:
    """The :class:`~rolling_forcing.config.ModelConfig` of a diffusers ``WanTransformer3DModel`` config.

    Args:
        config: ``transformer.config`` or the ``config.json`` of a ``save_pretrained`` directory.
        latent_size: ``(latent_height, latent_width)`` of the stream (diffusers' model takes any size; the
            project's static-shape stream fixes one: 60 x 104 for 480 x 832 video with Wan's VAE).
        text_len: text tokens the prompt is padded to (512 for Wan's umT5).
        name: the config's name (reports only).

    Raises ``ValueError`` naming the field for another class (``_class_name``), a variant the causal model
    does not have (``image_dim``, ``added_kv_proj_dim``, ``pos_embed_seq_len`` set; ``cross_attn_norm``
    false), a missing field, or sizes :class:`ModelConfig` refuses (its own messages).
    """
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be a mapping (transformer.config), got {type(config).__name__}")
    cls = config.get("_class_name", "WanTransformer3DModel")
    if cls != "WanTransformer3DModel":
        raise ValueError(f"config._class_name is {cls!r}; only diffusers' WanTransformer3DModel is supported")
    for field, what in _UNSUPPORTED.items():
        if config.get(field) is not None:
            raise ValueError(
                f"config.{field}={config[field]!r}: {what} is not part of the causal text-to-video Wan model "
                "the project streams"
            )
    if not config.get("cross_attn_norm", True):
        raise ValueError(
            "config.cross_attn_norm=False: the causal Wan model has an affine LayerNorm before "
            "cross-attention"
        )
    need = (
        "num_attention_heads",
        "attention_head_dim",
        "in_channels",
        "text_dim",
        "freq_dim",
        "ffn_dim",
        "num_layers",
        "patch_size",
    )
    missing = [k for k in need if k not in config]
    if missing:
        raise ValueError(f"config lacks {missing} (not a WanTransformer3DModel config?)")
    h, w = _int_pair("latent_size", latent_size)
    if isinstance(text_len, bool) or not isinstance(text_len, int) or text_len < 1:
        raise ValueError(f"text_len must be an int >= 1, got {text_len!r}")
    heads, hd = int(config["num_attention_heads"]), int(config["attention_head_dim"])
    in_ch = int(config["in_channels"])
    out_ch = config.get("out_channels") or in_ch  # diffusers: out_channels or in_channels
    return ModelConfig(
        name=name,
        num_layers=int(config["num_layers"]),
        dim=heads * hd,
        num_heads=heads,
        ffn_dim=int(config["ffn_dim"]),
        freq_dim=int(config["freq_dim"]),
        text_dim=int(config["text_dim"]),
        text_len=text_len,
        latent_height=h,
        latent_width=w,
        patch_size=tuple(int(p) for p in config["patch_size"]),  # type: ignore[arg-type]
        in_channels=in_ch,
        out_channels=int(out_ch),
        eps=float(config.get("eps", 1e-6)),
    )


def _config_dir(path: Path) -> Path:
    if (path / "config.json").is_file():
        return path
    if (path / "transformer" / "config.json").is_file():  # a diffusers pipeline checkout
        return path / "transformer"
    raise ValueError(
        f"source {str(path)!r} has no config.json (nor transformer/config.json): pass the directory "
        "WanTransformer3DModel.save_pretrained wrote"
    )


def _check_plain_forward(transformer: torch.nn.Module) -> None:
    """Refuse what diffusers' forward would run but the stream's would not (it would be ignored, silently).

    ``ValueError`` naming the module for: diffusers hooks registered on any module (``enable_cache``,
    group offloading, layerwise casting, context parallelism), an attention processor other than diffusers'
    ``WanAttnProcessor`` or the project's ``NkiWanAttnProcessor`` (both the stream's math), and a diffusers
    attention backend set on a processor (``set_attention_backend``).
    """
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    from nki_ardiff.integrations.diffusers import NkiWanAttnProcessor

    for name, mod in transformer.named_modules():
        where = f"transformer{'.' + name if name else ''} ({type(mod).__name__})"
        registry = getattr(mod, "_diffusers_hook", None)
        hooks = getattr(registry, "hooks", None)
        if hooks:
            raise ValueError(
                f"{where}: diffusers hooks {sorted(hooks)} are registered (caching, offloading, layerwise "
                "casting or parallelism); the stream runs the project's forward, which would ignore them: "
                "remove them first (e.g. transformer.disable_cache())"
            )
        proc = getattr(mod, "processor", None)
        if proc is None or not hasattr(mod, "set_processor"):
            continue
        if type(proc) not in (WanAttnProcessor, NkiWanAttnProcessor):  # a subclass may change the math
            raise ValueError(
                f"{where}: attention processor {type(proc).__name__} would be ignored (the stream attends "
                "with the project's ops, the math of WanAttnProcessor); restore diffusers' processor first "
                "(transformer.set_attn_processor(WanAttnProcessor()))"
            )
        if getattr(proc, "_attention_backend", None) is not None:
            raise ValueError(
                f"{where}: a diffusers attention backend ({proc._attention_backend}) is set; the stream runs "
                "the project's ops (backend= of stream_from_diffusers) and would ignore it: "
                "transformer.reset_attention_backend() first"
            )


def _shared_model(
    transformer: torch.nn.Module, cfg: ModelConfig, dtype: torch.dtype | None
) -> CausalWanModel:
    params = dict(transformer.named_parameters())
    dtypes = {p.dtype for p in params.values()}
    devices = {p.device for p in params.values()}
    if len(dtypes) != 1 or len(devices) != 1:
        odd = next(
            (n for n, p in params.items() if p.dtype != next(iter(params.values())).dtype),
            next(iter(params)),
        )
        raise ValueError(
            f"transformer: parameters of several dtypes {sorted(map(str, dtypes))} or devices "
            f"{sorted(map(str, devices))} (e.g. {odd!r}); the project's model shares one dtype and device "
            "(a model loaded with torch_dtype=bfloat16 keeps some modules in fp32): call "
            "transformer.to(dtype) first"
        )
    have = dtypes.pop()
    if dtype is not None and have != dtype:
        raise ValueError(
            f"transformer parameters are {have} but the stream runs in {dtype} (pipe_cfg.dtype): cast the "
            f"transformer (.to({dtype})) or choose pipe_cfg.dtype to match"
        )
    try:
        wan = diffusers_to_wan(params)
    except CheckpointError as exc:
        raise ValueError(
            f"transformer: {exc}. A PEFT/LoRA adapter must be fused first (transformer.fuse_lora() then "
            "unload_lora_weights()); fused projections unfused (transformer.unfuse_qkv_projections())"
        ) from exc
    with torch.device("meta"):
        model = CausalWanModel(cfg)
    report = compare_keys(wan, model.state_dict())
    if not report.ok:
        raise ValueError(f"transformer does not fit the config's CausalWanModel:\n{report.describe()}")
    check_tensors(wan, "transformer")
    for key, p in wan.items():
        owner, _, leaf = key.rpartition(".")
        setattr(model.get_submodule(owner), leaf, p)  # the same Parameter object: shared, not copied
    left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if left:  # every parameter has a diffusers counterpart (compare_keys), so this cannot happen
        raise RuntimeError(f"parameters left unassigned: {left[:5]}")
    return model.eval()


def causal_wan_from_diffusers(
    source: torch.nn.Module | str | Path,
    *,
    latent_size: tuple[int, int],
    text_len: int = WAN_TEXT_LEN,
    dtype: torch.dtype | None = None,
) -> tuple[CausalWanModel, ModelConfig]:
    """The project's :class:`~rolling_forcing.model.CausalWanModel` on the weights of a diffusers Wan model.

    Args:
        source: a diffusers ``WanTransformer3DModel`` (its parameters are shared, not copied: one dtype
            and device for all of them), or the directory ``save_pretrained`` wrote (``config.json`` +
            ``.safetensors``; a pipeline checkout's ``transformer/`` is found), read on CPU.
        latent_size, text_len: see :func:`model_config_from_diffusers`.
        dtype: the model's dtype (``torch.float32`` / ``torch.bfloat16``). A directory's weights are cast to
            it (None: float32); a model in memory must already be in it (None: whatever it is).

    Returns:
        ``(model, model_cfg)``, the model in eval mode.

    Raises ``TypeError`` for another source type; ``ValueError`` naming the field, parameter or module for a
    config variant (:func:`model_config_from_diffusers`), a model in memory whose forward diffusers would
    change (hooks, a custom attention processor, an attention backend), parameters of several dtypes or
    devices or of another dtype than ``dtype``, parameters without a Wan name, or a directory without a
    diffusers config and weights.
    """
    if dtype is not None and dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dtype must be torch.float32, torch.bfloat16 or None, got {dtype!r}")
    if isinstance(source, torch.nn.Module):
        from diffusers import WanTransformer3DModel

        if not isinstance(source, WanTransformer3DModel):
            raise TypeError(
                "source must be a diffusers WanTransformer3DModel or a directory, got "
                f"{type(source).__name__}"
            )
        config: Mapping[str, Any] = source.config  # type: ignore[assignment]
        cfg = model_config_from_diffusers(config, latent_size=latent_size, text_len=text_len)
        _check_plain_forward(source)
        return _shared_model(source, cfg, dtype), cfg
    if not isinstance(source, (str, Path)):
        raise TypeError(
            f"source must be a WanTransformer3DModel or a directory path, got {type(source).__name__}"
        )
    path = Path(source)
    if not path.is_dir():
        raise ValueError(f"source {str(path)!r} is not a directory (the one save_pretrained wrote)")
    cdir = _config_dir(path)
    config = json.loads((cdir / "config.json").read_text())
    cfg = model_config_from_diffusers(config, latent_size=latent_size, text_len=text_len)
    model = CausalWanModel(cfg)
    fmt = load_checkpoint(model, cdir)
    if fmt != "diffusers":
        raise ValueError(
            f"source {str(cdir)!r} holds Wan-layout weights; load them with CausalWanModel directly"
        )
    return model.to(dtype or torch.float32).eval(), cfg


def stream_from_diffusers(
    source: torch.nn.Module | str | Path,
    pipe_cfg: PipelineConfig | None = None,
    *,
    latent_size: tuple[int, int],
    text_len: int = WAN_TEXT_LEN,
    method: str | StreamMethod | None = None,
    backend: str | None = None,
    positions: str | None = None,
    merged: bool | None = None,
    compile: CompileSpec = None,
    static: bool = False,
    kv_dtype: str | None = None,
) -> RollingForcingPipeline:
    """A :class:`~rolling_forcing.pipeline.RollingForcingPipeline` streaming a diffusers Wan model.

    Args:
        source: see :func:`causal_wan_from_diffusers` (a model in memory must be in ``pipe_cfg.dtype``).
        pipe_cfg: the stream's configuration (None: :class:`PipelineConfig` defaults, fp32 Rolling Forcing).
        latent_size, text_len: see :func:`model_config_from_diffusers`.
        method, backend, positions, merged, compile, static, kv_dtype: as
            :class:`~rolling_forcing.pipeline.RollingForcingPipeline` takes them.

    Returns the pipeline; ``pipe.stream(text_embeds [B, L<=text_len, text_dim], num_blocks)`` yields chunks
    of latents ``[B, frames_per_block, C, H, W]``, ``pipe.model`` is the (parameter-sharing) model.
    """
    pc = PipelineConfig() if pipe_cfg is None else pipe_cfg
    if not isinstance(pc, PipelineConfig):
        raise TypeError(f"pipe_cfg must be a PipelineConfig or None, got {type(pc).__name__}")
    if method is not None:  # names checked before any weight is read (the pipeline checks the rest)
        get_method(method)
    if backend is not None:
        ops.resolve_backend(backend)
    model, cfg = causal_wan_from_diffusers(
        source, latent_size=latent_size, text_len=text_len, dtype=pc.torch_dtype
    )
    return RollingForcingPipeline(
        model,
        cfg,
        pc,
        method=method,
        backend=backend,
        positions=positions,
        merged=merged,
        compile=compile,
        static=static,
        kv_dtype=kv_dtype,
    )


__all__ = [
    "WAN_TEXT_LEN",
    "causal_wan_from_diffusers",
    "model_config_from_diffusers",
    "stream_from_diffusers",
]
