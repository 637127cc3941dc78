"""Loading Wan2.1 / Rolling Forcing transformer weights from local files.

Two key layouts are understood and detected automatically:

* ``"wan"``: the original Wan2.1 names, also used by Self Forcing and Rolling Forcing
  (``blocks.{i}.self_attn.q``, ``blocks.{i}.norm3``, ``head.head`` ...). The RF training checkpoint wraps
  them as ``{"generator": {...}, "generator_ema": {...}}`` with a ``model.`` prefix (the generator is a
  ``WanDiffusionWrapper`` holding the ``CausalWanModel`` as ``.model``); ComfyUI-style files use a
  ``model.diffusion_model.`` prefix. Both wrappers are removed here.
* ``"diffusers"``: the names of diffusers' ``WanTransformer3DModel`` (``condition_embedder.*``,
  ``blocks.{i}.attn1.to_q``, ``scale_shift_table``, ``proj_out`` ...).

The mapping between the two is a pure renaming: every tensor keeps its shape. The one subtlety is the
layer-norm numbering. In Wan, ``norm1`` (self-attention) and ``norm2`` (FFN) have no parameters and
``norm3`` is the affine cross-attention norm; diffusers calls the cross-attention norm ``norm2`` and the FFN
norm ``norm3``. Only the affine one is in a state dict, so Wan ``norm3`` <-> diffusers ``norm2``.

File formats: ``.safetensors`` (preferred; a directory of shards, with or without an index json, is also
accepted) and ``.pt``/``.pth``/``.bin`` read only through ``torch.load(weights_only=True)``. A pickle that
needs arbitrary code to load is refused with an error that says so; nothing is ever downloaded.
"""

from __future__ import annotations

import json
import pickle
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import save_file

from rolling_forcing.tensor_io import check_finite, load_safetensors

KeyFormat = Literal["wan", "diffusers"]

SAFETENSORS_SUFFIXES = (".safetensors",)
PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")

# (wan pattern, diffusers pattern) pairs; patterns are anchored regexes over the whole key where
# ``{i}`` stands for a block index. Order does not matter: each key matches at most one rule.
_RULES: tuple[tuple[str, str], ...] = (
    ("patch_embedding.{p}", "patch_embedding.{p}"),
    ("text_embedding.0.{p}", "condition_embedder.text_embedder.linear_1.{p}"),
    ("text_embedding.2.{p}", "condition_embedder.text_embedder.linear_2.{p}"),
    ("time_embedding.0.{p}", "condition_embedder.time_embedder.linear_1.{p}"),
    ("time_embedding.2.{p}", "condition_embedder.time_embedder.linear_2.{p}"),
    ("time_projection.1.{p}", "condition_embedder.time_proj.{p}"),
    ("blocks.{i}.modulation", "blocks.{i}.scale_shift_table"),
    ("blocks.{i}.self_attn.q.{p}", "blocks.{i}.attn1.to_q.{p}"),
    ("blocks.{i}.self_attn.k.{p}", "blocks.{i}.attn1.to_k.{p}"),
    ("blocks.{i}.self_attn.v.{p}", "blocks.{i}.attn1.to_v.{p}"),
    ("blocks.{i}.self_attn.o.{p}", "blocks.{i}.attn1.to_out.0.{p}"),
    ("blocks.{i}.self_attn.norm_q.{p}", "blocks.{i}.attn1.norm_q.{p}"),
    ("blocks.{i}.self_attn.norm_k.{p}", "blocks.{i}.attn1.norm_k.{p}"),
    ("blocks.{i}.norm3.{p}", "blocks.{i}.norm2.{p}"),
    ("blocks.{i}.cross_attn.q.{p}", "blocks.{i}.attn2.to_q.{p}"),
    ("blocks.{i}.cross_attn.k.{p}", "blocks.{i}.attn2.to_k.{p}"),
    ("blocks.{i}.cross_attn.v.{p}", "blocks.{i}.attn2.to_v.{p}"),
    ("blocks.{i}.cross_attn.o.{p}", "blocks.{i}.attn2.to_out.0.{p}"),
    ("blocks.{i}.cross_attn.norm_q.{p}", "blocks.{i}.attn2.norm_q.{p}"),
    ("blocks.{i}.cross_attn.norm_k.{p}", "blocks.{i}.attn2.norm_k.{p}"),
    ("blocks.{i}.ffn.0.{p}", "blocks.{i}.ffn.net.0.proj.{p}"),
    ("blocks.{i}.ffn.2.{p}", "blocks.{i}.ffn.net.2.{p}"),
    ("head.head.{p}", "proj_out.{p}"),
    ("head.modulation", "scale_shift_table"),
)


def _compile(pattern: str) -> tuple[re.Pattern[str], str]:
    regex = re.escape(pattern).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{p\}", r"(?P<p>weight|bias)")
    template = pattern.replace("{i}", r"\g<i>").replace("{p}", r"\g<p>")
    return re.compile(f"^{regex}$"), template


_WAN_TO_DIFF = [(_compile(w)[0], _compile(d)[1]) for w, d in _RULES]
_DIFF_TO_WAN = [(_compile(d)[0], _compile(w)[1]) for w, d in _RULES]

# Keys that identify a layout unambiguously.
_WAN_MARKERS = ("head.head.", "time_projection.", ".self_attn.", "text_embedding.")
_DIFF_MARKERS = ("condition_embedder.", "proj_out.", ".attn1.", "scale_shift_table")

# Wrapper prefixes that are stripped when *every* key carries them (outermost first).
_STRIP_PREFIXES = ("module.", "_orig_mod.", "model.diffusion_model.", "model.", "_fsdp_wrapped_module.")


class CheckpointError(ValueError):
    """A checkpoint file or state dict does not fit the model; the message says what and why."""


@dataclass(frozen=True)
class KeyReport:
    """Differences between a state dict and the keys/shapes a model expects."""

    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()
    mis_shaped: tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...] = field(default=())

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.mis_shaped)

    def describe(self, limit: int = 20) -> str:
        """Human-readable listing, at most ``limit`` entries per category."""

        def _cut(items: list[str]) -> str:
            extra = f"\n    ... and {len(items) - limit} more" if len(items) > limit else ""
            return "\n".join(f"    {s}" for s in items[:limit]) + extra

        parts = []
        if self.missing:
            parts.append(f"  missing keys ({len(self.missing)}):\n" + _cut(list(self.missing)))
        if self.unexpected:
            parts.append(f"  unexpected keys ({len(self.unexpected)}):\n" + _cut(list(self.unexpected)))
        if self.mis_shaped:
            rows = [f"{k}: checkpoint {list(got)} vs model {list(want)}" for k, got, want in self.mis_shaped]
            parts.append(f"  mis-shaped keys ({len(self.mis_shaped)}):\n" + _cut(rows))
        return "\n".join(parts) if parts else "  all keys match"


def _rename(
    state: Mapping[str, torch.Tensor], rules: list[tuple[re.Pattern[str], str]], src: str
) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    unknown: list[str] = []
    for key, value in state.items():
        for regex, template in rules:
            if regex.match(key):
                out[regex.sub(template, key)] = value
                break
        else:
            unknown.append(key)
    if unknown:
        shown = ", ".join(unknown[:10]) + (" ..." if len(unknown) > 10 else "")
        raise CheckpointError(
            f"{len(unknown)} key(s) have no mapping from the {src} layout (image-to-video, VACE or other "
            f"variants are not supported): {shown}"
        )
    return out


def wan_to_diffusers(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename a Wan2.1-layout state dict to diffusers ``WanTransformer3DModel`` names (shapes unchanged)."""
    return _rename(state, _WAN_TO_DIFF, "wan")


def diffusers_to_wan(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename a diffusers ``WanTransformer3DModel`` state dict to Wan2.1 names (shapes unchanged)."""
    return _rename(state, _DIFF_TO_WAN, "diffusers")


def detect_format(state: Mapping[str, torch.Tensor]) -> KeyFormat:
    """Return ``"wan"`` or ``"diffusers"`` from the key names; raise if neither or both fit."""
    keys = list(state)
    is_wan = any(m in k for k in keys for m in _WAN_MARKERS)
    is_diff = any(m in k for k in keys for m in _DIFF_MARKERS)
    if is_wan and not is_diff:
        return "wan"
    if is_diff and not is_wan:
        return "diffusers"
    sample = ", ".join(keys[:5])
    why = "keys of both layouts" if is_wan else "no key of either layout"
    raise CheckpointError(
        f"cannot tell the key layout of this state dict ({why}); expected Wan2.1 names such as "
        f"'blocks.0.self_attn.q.weight' or diffusers names such as 'blocks.0.attn1.to_q.weight'; "
        f"first keys: {sample}"
    )


def unwrap_checkpoint(obj: object, *, use_ema: bool = False) -> dict[str, torch.Tensor]:
    """Take the transformer state dict out of a checkpoint object.

    Handles the RF/SF training format ``{"generator": sd, "generator_ema": sd, ...}`` (``use_ema`` picks
    ``generator_ema``), a ``{"state_dict": sd}`` / ``{"model": sd}`` wrapper, and strips prefixes shared by
    every key (``model.``, ``model.diffusion_model.``, ``module.``, ``_orig_mod.``).
    """
    if not isinstance(obj, Mapping):
        raise CheckpointError(f"checkpoint must hold a dict of tensors, got {type(obj).__name__}")
    if "generator" in obj or "generator_ema" in obj:
        want = "generator_ema" if use_ema else "generator"
        if want not in obj:
            raise CheckpointError(
                f"use_ema={use_ema} needs the key '{want}' in the training checkpoint, which only has "
                f"{sorted(k for k in obj if isinstance(k, str))}"
            )
        obj = obj[want]
    elif use_ema:
        raise CheckpointError(
            "use_ema=True needs a training checkpoint with a 'generator_ema' entry; this file is a plain "
            "state dict"
        )
    else:
        for wrapper in ("state_dict", "model"):
            inner = obj.get(wrapper) if isinstance(obj, Mapping) else None
            if (
                isinstance(inner, Mapping)
                and inner
                and all(isinstance(v, torch.Tensor) for v in inner.values())
            ):
                obj = inner
                break
    if not isinstance(obj, Mapping):
        raise CheckpointError(f"checkpoint entry must be a dict of tensors, got {type(obj).__name__}")
    bad = [str(k) for k, v in obj.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if bad:
        raise CheckpointError(f"checkpoint entries that are not named tensors: {bad[:10]}")
    state: dict[str, torch.Tensor] = dict(obj)
    changed = True
    while changed and state:
        changed = False
        for prefix in _STRIP_PREFIXES:
            if all(k.startswith(prefix) for k in state):
                state = {k[len(prefix) :]: v for k, v in state.items()}
                changed = True
                break
    # FSDP-gathered EMA weights (LongLive's longlive_base.pt) carry the wrapper inside the names
    return {k.replace("_fsdp_wrapped_module.", ""): v for k, v in state.items()}


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """``safetensors.torch.load_file`` on CPU; a truncated or corrupt file raises :class:`CheckpointError`."""
    return load_safetensors(path, CheckpointError)


def check_tensors(state: Mapping[str, torch.Tensor], source: str) -> None:
    """Refuse non-floating or non-finite tensors, naming the first bad key (:class:`CheckpointError`).

    Floating dtypes only (a model's weights; an int32 tensor here is a wrong file, not a quantised one),
    and every value finite: a NaN or inf weight would stream an all-black video without an error.
    """
    for key, t in state.items():
        if not t.is_floating_point():
            raise CheckpointError(f"{source}: tensor {key!r} has dtype {t.dtype}; weights must be floating")
        check_finite(t, f"{source}: tensor {key!r}", CheckpointError)


def _torch_load_weights_only(path: Path) -> object:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"{path}: this pickle is not weights-only (it needs arbitrary Python objects to load), so it is "
            f"refused: loading it would execute code from the file. Convert it to .safetensors in an "
            f"environment you trust (torch.load(..., weights_only=False) then "
            f"rolling_forcing.checkpoint.save_safetensors). Detail: {str(exc).splitlines()[0]}"
        ) from exc


def read_state_dict(path: str | Path) -> object:
    """Read a raw checkpoint object from a local file or directory of ``.safetensors`` shards.

    Never downloads. ``.safetensors`` is read with ``safetensors.torch.load_file``; pickles only with
    ``torch.load(weights_only=True)``.
    """
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint path {str(p)!r} does not exist (only local files are loaded)")
    if p.is_dir():
        if not any(p.glob("*.safetensors")) and (p / "transformer").is_dir():
            p = p / "transformer"  # a diffusers pipeline checkout: the DiT lives in transformer/
        index = sorted(p.glob("*.safetensors.index.json"))
        if index:
            shards = sorted(set(json.loads(index[0].read_text())["weight_map"].values()))
            files = [p / s for s in shards]
        else:
            files = sorted(p.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"directory {str(p)!r} holds no .safetensors files")
        merged: dict[str, torch.Tensor] = {}
        for f in files:
            merged.update(read_safetensors(f))
        return merged
    if p.name.endswith(SAFETENSORS_SUFFIXES):
        return read_safetensors(p)
    if p.name.endswith(PICKLE_SUFFIXES):
        return _torch_load_weights_only(p)
    raise CheckpointError(
        f"checkpoint {str(p)!r}: unknown file type; expected one of "
        f"{SAFETENSORS_SUFFIXES + PICKLE_SUFFIXES} or a directory of .safetensors shards"
    )


def load_wan_state_dict(
    path: str | Path, *, use_ema: bool = False
) -> tuple[dict[str, torch.Tensor], KeyFormat]:
    """Read a checkpoint file and return it in Wan2.1 key names, plus the layout it was stored in."""
    state = unwrap_checkpoint(read_state_dict(path), use_ema=use_ema)
    fmt = detect_format(state)
    if fmt == "diffusers":
        state = diffusers_to_wan(state)
    return state, fmt


def compare_keys(state: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]) -> KeyReport:
    """List missing, unexpected and mis-shaped keys of ``state`` against ``expected`` (e.g. a model's)."""
    missing = tuple(sorted(k for k in expected if k not in state))
    unexpected = tuple(sorted(k for k in state if k not in expected))
    mis_shaped = tuple(
        (k, tuple(state[k].shape), tuple(expected[k].shape))
        for k in sorted(state)
        if k in expected and tuple(state[k].shape) != tuple(expected[k].shape)
    )
    return KeyReport(missing, unexpected, mis_shaped)


def load_into(
    model: torch.nn.Module,
    state: Mapping[str, torch.Tensor],
    *,
    source: str = "state dict",
) -> KeyReport:
    """Copy a Wan-layout state dict into ``model`` (strict), casting to each parameter's dtype.

    Raises :class:`CheckpointError` listing every missing, unexpected and mis-shaped key if the dict does
    not fit exactly, or naming the first tensor that is not floating or holds NaN/inf
    (:func:`check_tensors`); the model is left untouched in both cases.
    """
    expected = model.state_dict()
    report = compare_keys(state, expected)
    if not report.ok:
        raise CheckpointError(f"{source} does not fit {type(model).__name__}:\n{report.describe()}")
    check_tensors(state, source)
    cast = {k: v.to(dtype=expected[k].dtype) for k, v in state.items()}
    model.load_state_dict(cast, strict=True)
    return report


def load_checkpoint(
    model: torch.nn.Module,
    path: str | Path,
    *,
    use_ema: bool = False,
    lora: str | Path | None = None,
    lora_alpha: float | None = None,
) -> KeyFormat:
    """Load weights for ``model`` (Wan2.1 key names) from a local file; returns the detected layout.

    Args:
        model: a module whose ``state_dict()`` uses the Wan2.1 names (``CausalWanModel``).
        path: ``.safetensors`` file (preferred), a directory of shards, or a weights-only pickle. The
            Rolling Forcing, Self-Forcing, CausVid and LongLive training files (``{"generator": ...,
            "generator_ema": ...}`` with a ``model.`` prefix) are unwrapped.
        use_ema: for training checkpoints, take ``generator_ema`` instead of ``generator``.
        lora: a PEFT LoRA file (LongLive's ``lora.pt``) merged into the weights at load
            (:mod:`rolling_forcing.lora`); ``lora_alpha`` None = its rank (LongLive's alpha = rank).
    """
    state, fmt = load_wan_state_dict(path, use_ema=use_ema)
    if lora is not None:
        from rolling_forcing.lora import load_lora, merge_lora

        state = merge_lora(state, load_lora(lora), alpha=lora_alpha)
    load_into(model, state, source=f"checkpoint {str(path)!r} ({fmt} layout)")
    return fmt


def save_safetensors(state: Mapping[str, torch.Tensor], path: str | Path) -> None:
    """Write a state dict as ``.safetensors`` (tensors made contiguous and moved to CPU)."""
    p = Path(path)
    if not p.name.endswith(SAFETENSORS_SUFFIXES):
        raise ValueError(f"path must end with .safetensors, got {str(p)!r}")
    save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, str(p))


def convert_file(src: str | Path, dst: str | Path, *, to: KeyFormat = "wan", use_ema: bool = False) -> None:
    """Convert a checkpoint to ``.safetensors`` in the requested key layout."""
    state, _ = load_wan_state_dict(src, use_ema=use_ema)
    converter: Callable[[Mapping[str, torch.Tensor]], dict[str, torch.Tensor]] = (
        wan_to_diffusers if to == "diffusers" else dict
    )
    save_safetensors(converter(state), dst)
