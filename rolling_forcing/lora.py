"""LongLive's LoRA weights: read a PEFT LoRA state dict and merge it into Wan2.1 weights at load.

LongLive 1.0 (github.com/NVlabs/LongLive, branch v1.0 @ e52d9ef: ``utils/lora_utils.py``,
``interactive_inference.py``, ``configs/longlive_interactive_inference.yaml``) loads its base generator
(``longlive_base.pt``: ``{"generator": ..., "generator_ema": ...}``, the layout
:func:`rolling_forcing.checkpoint.unwrap_checkpoint` reads) and then wraps every ``nn.Linear`` inside
each transformer block with PEFT LoRA (rank 256, alpha 256) whose weights come from ``lora.pt``:
``{"generator_lora": sd}`` or ``sd`` itself, with PEFT's keys
``base_model.model.<module>.lora_A.weight`` ``[r, in]`` and ``...lora_B.weight`` ``[out, r]``.
A LoRA linear computes ``W x + b + (alpha / r) B (A x)``; merging gives the same map with
``W' = W + (alpha / r) B A`` (computed in float32, cast to W's dtype), so the model needs no extra op.

Files are read like checkpoints (:func:`rolling_forcing.checkpoint.read_state_dict`: ``.safetensors`` or a
weights-only pickle; other pickles are refused).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

import torch

from rolling_forcing.checkpoint import CheckpointError, read_state_dict

_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[A-Za-z0-9_]+)?\.weight$")
_PREFIXES = ("base_model.model.", "model.", "_orig_mod.", "module.")


def lora_pairs(obj: object) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The ``{module: (A [r, in], B [out, r])}`` pairs of a PEFT LoRA state dict (Wan module names).

    Accepts ``{"generator_lora": sd}`` or ``sd``; strips ``base_model.model.`` / ``model.`` prefixes and
    PEFT adapter names (``lora_A.default.weight``); ignores nothing: a key that is not a LoRA A/B weight,
    an A without its B (or the reverse) or a rank mismatch raises :class:`CheckpointError`.
    """
    if isinstance(obj, Mapping) and "generator_lora" in obj:
        obj = obj["generator_lora"]
    if not isinstance(obj, Mapping) or not obj:
        raise CheckpointError(f"a LoRA file must hold a non-empty dict of tensors, got {type(obj).__name__}")
    found: dict[str, dict[str, torch.Tensor]] = {}
    bad = []
    for key, val in obj.items():
        m = _KEY.match(str(key)) if isinstance(val, torch.Tensor) else None
        if m is None or val.dim() != 2:
            bad.append(str(key))
            continue
        name = m["module"].replace("_fsdp_wrapped_module.", "")
        for p in _PREFIXES:
            if name.startswith(p):
                name = name[len(p) :]
        found.setdefault(name, {})[m["ab"]] = val
    if bad:
        raise CheckpointError(f"LoRA entries that are not 2-D lora_A/lora_B weights: {bad[:10]}")
    out = {}
    for name, ab in sorted(found.items()):
        if set(ab) != {"A", "B"}:
            only = "".join(ab)
            raise CheckpointError(f"LoRA module {name!r} has only lora_{only}; both A and B are needed")
        a, b = ab["A"], ab["B"]
        if a.shape[0] != b.shape[1]:
            raise CheckpointError(
                f"LoRA module {name!r}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} disagree on "
                "the rank"
            )
        out[name] = (a, b)
    return out


def merge_lora(
    state: Mapping[str, torch.Tensor],
    pairs: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    *,
    alpha: float | None = None,
) -> dict[str, torch.Tensor]:
    """``state`` (Wan names) with ``W + (alpha / r) B A`` for every LoRA module ``pairs`` names.

    ``alpha`` None = the rank (LongLive: alpha = rank = 256, scale 1). Raises :class:`CheckpointError`
    listing modules that are not ``<module>.weight`` of ``state`` or whose ``[out, in]`` does not match
    ``B A``; ``state`` is not modified.
    """
    missing = [n for n in pairs if f"{n}.weight" not in state]
    if missing:
        raise CheckpointError(f"LoRA modules with no weight in the base state dict: {missing[:10]}")
    out = dict(state)
    wrong = []
    for name, (a, b) in pairs.items():
        w = state[f"{name}.weight"]
        if tuple(w.shape) != (b.shape[0], a.shape[1]):
            wrong.append(f"{name}: weight {tuple(w.shape)} vs B A {(b.shape[0], a.shape[1])}")
            continue
        scale = (a.shape[0] if alpha is None else alpha) / a.shape[0]
        out[f"{name}.weight"] = (w.float() + scale * (b.float() @ a.float())).to(w.dtype)
    if wrong:
        raise CheckpointError("LoRA shapes do not fit the base weights: " + "; ".join(wrong[:10]))
    return out


def load_lora(path: str | Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Read a LoRA file (``.safetensors`` or weights-only pickle) into :func:`lora_pairs`."""
    return lora_pairs(read_state_dict(path))


__all__ = ["load_lora", "lora_pairs", "merge_lora"]
