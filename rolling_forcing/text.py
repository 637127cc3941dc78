"""Prompt -> text embeddings ``[B, text_len, text_dim]`` (float32 unless a dtype is given).

Three sources, all local:

* :class:`UMT5TextEncoder`: umT5 through ``transformers`` (``UMT5EncoderModel`` + its tokenizer) from a
  local directory (``local_files_only=True``, never downloads). As in Rolling Forcing's
  ``WanTextEncoder``: pad/truncate to ``text_len`` tokens, run the encoder with the attention mask, and
  zero the outputs at padding positions (the DiT then attends to all ``text_len`` positions, padding
  included, with no mask).
* :func:`load_prompt_embeds`: precomputed embeddings from a ``.safetensors`` file, shape
  ``[1 or B, text_len, text_dim]``, validated.
* :class:`SeededTextEncoder`: for the ``tiny`` preset (no umT5). The embedding is a deterministic function
  of the prompt string: SHA-256 of the UTF-8 prompt seeds a ``torch.Generator``; the number of "tokens"
  is the whitespace word count + 1 (capped at ``text_len``) and positions after it are zero, mimicking the
  padded layout. It carries no meaning; it only makes different prompts give different, reproducible
  conditioning.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from rolling_forcing.tensor_io import check_finite, load_safetensors

PROMPT_EMBEDS_KEY = "prompt_embeds"


class TextEncoder(Protocol):
    """Anything that turns prompts into ``[B, text_len, text_dim]`` embeddings."""

    text_len: int
    text_dim: int

    def encode(self, prompts: Sequence[str]) -> torch.Tensor:
        """``B`` prompts (a ``str`` counts as one) -> ``[B, text_len, text_dim]``; empty input raises."""
        ...


def _check_prompts(prompts: Sequence[str]) -> list[str]:
    if isinstance(prompts, str):
        prompts = [prompts]
    out = list(prompts)
    if not out or not all(isinstance(p, str) for p in out):
        raise TypeError(f"prompts must be a non-empty sequence of str, got {prompts!r}")
    return out


def whitespace_clean(text: str) -> str:
    """Collapse runs of whitespace and strip (Wan's ``clean='whitespace'`` without ftfy/html fixing)."""
    return " ".join(text.split())


class SeededTextEncoder:
    """Deterministic pseudo-embeddings for the ``tiny`` preset (see module docstring).

    Output: float32 ``[B, text_len, text_dim]``, N(0, 1) entries on the first ``n_tokens`` rows, zeros after.
    """

    def __init__(self, text_len: int, text_dim: int) -> None:
        if text_len <= 0 or text_dim <= 0:
            raise ValueError(f"text_len and text_dim must be positive, got {text_len}, {text_dim}")
        self.text_len = text_len
        self.text_dim = text_dim

    @staticmethod
    def seed_of(prompt: str) -> int:
        """63-bit seed from the SHA-256 of the UTF-8 prompt (stable across runs and platforms)."""
        return int.from_bytes(hashlib.sha256(prompt.encode("utf-8")).digest()[:8], "little") >> 1

    def encode(self, prompts: Sequence[str]) -> torch.Tensor:
        """``B`` prompts -> float32 ``[B, text_len, text_dim]`` (see the class docstring)."""
        rows = []
        for prompt in _check_prompts(prompts):
            clean = whitespace_clean(prompt)
            gen = torch.Generator().manual_seed(self.seed_of(clean))
            emb = torch.randn(self.text_len, self.text_dim, generator=gen)
            n_tokens = min(self.text_len, len(clean.split()) + 1)
            emb[n_tokens:] = 0.0
            rows.append(emb)
        return torch.stack(rows)


class UMT5TextEncoder:
    """umT5 encoder + tokenizer loaded from a local directory through ``transformers``.

    Args:
        path: directory holding the encoder weights/config and the tokenizer files (a Wan2.1-Diffusers
            checkout has them under ``text_encoder/`` and ``tokenizer/``; both layouts are accepted).
        text_len: tokens per prompt (512 for Wan2.1); longer prompts are truncated.
        dtype: dtype of the encoder weights and the returned embeddings.
    """

    def __init__(
        self,
        path: str | Path,
        text_len: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        from transformers import AutoTokenizer, UMT5EncoderModel

        root = Path(path)
        if not root.is_dir():
            raise ValueError(f"text_encoder path {str(root)!r} is not a local directory")
        enc_dir = root / "text_encoder" if (root / "text_encoder").is_dir() else root
        tok_dir = root / "tokenizer" if (root / "tokenizer").is_dir() else root
        self.tokenizer: Any = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
        self.model: Any = UMT5EncoderModel.from_pretrained(
            str(enc_dir), local_files_only=True, torch_dtype=dtype
        )
        self.model.eval().to(device)
        self.text_len = text_len
        self.text_dim = int(self.model.config.d_model)
        self.device = torch.device(device)
        self.dtype = dtype

    @torch.no_grad()
    def encode(self, prompts: Sequence[str]) -> torch.Tensor:
        """``B`` prompts -> ``[B, text_len, text_dim]`` in ``dtype``, padding positions zeroed."""
        texts = [whitespace_clean(p) for p in _check_prompts(prompts)]
        tok = self.tokenizer(
            texts,
            padding="max_length",
            max_length=self.text_len,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        ids = tok.input_ids.to(self.device)
        mask = tok.attention_mask.to(self.device)
        hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state
        # Zero the padding positions, as RF's WanTextEncoder does (u[v:] = 0).
        return (hidden * mask.unsqueeze(-1).to(hidden.dtype)).to(self.dtype)


def validate_prompt_embeds(
    embeds: torch.Tensor,
    text_len: int,
    text_dim: int,
    *,
    batch: int | None = None,
    name: str = "prompt_embeds",
) -> torch.Tensor:
    """Check ``embeds`` is ``[1 or B, text_len, text_dim]``, floating and finite; expand a batch of 1 to
    ``batch``. A NaN/inf value raises ``ValueError`` naming ``name`` (it would stream a blank video)."""
    if not isinstance(embeds, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(embeds).__name__}")
    if not embeds.is_floating_point():
        raise TypeError(f"{name} must be a floating tensor, got dtype {embeds.dtype}")
    shape = tuple(embeds.shape)
    ok_batch = len(shape) == 3 and (batch is None or shape[0] in (1, batch))
    if len(shape) != 3 or shape[1:] != (text_len, text_dim) or not ok_batch:
        want_b = "B" if batch is None else ("1" if batch == 1 else f"1 or {batch}")
        raise ValueError(
            f"{name} must have shape [{want_b}, text_len={text_len}, text_dim={text_dim}], got {list(shape)}"
        )
    check_finite(embeds, name, ValueError)
    if batch is not None and shape[0] == 1 and batch > 1:
        embeds = embeds.expand(batch, -1, -1)
    return embeds


def load_prompt_embeds(
    path: str | Path, text_len: int, text_dim: int, *, batch: int | None = None, key: str | None = None
) -> torch.Tensor:
    """Read precomputed embeddings from a local ``.safetensors`` file and validate their shape.

    The file must hold one tensor, or several with one named ``prompt_embeds`` (or ``key``).
    """
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"prompt_embeds file {str(p)!r} does not exist")
    if not p.name.endswith(".safetensors"):
        raise ValueError(f"prompt_embeds must be a .safetensors file, got {str(p)!r}")
    tensors = load_safetensors(p, ValueError)
    want = key or PROMPT_EMBEDS_KEY
    if want in tensors:
        embeds = tensors[want]
    elif key is None and len(tensors) == 1:
        embeds = next(iter(tensors.values()))
    else:
        raise ValueError(
            f"prompt_embeds file {str(p)!r} has tensors {sorted(tensors)}; expected one named {want!r}"
        )
    return validate_prompt_embeds(embeds, text_len, text_dim, batch=batch, name=f"prompt_embeds ({p.name})")
