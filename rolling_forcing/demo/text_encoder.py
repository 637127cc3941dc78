"""The demo model's text encoder: prompt words of :func:`rolling_forcing.procedural.vocabulary` ->
``[B, text_len, text_dim]`` float32 embeddings, trained jointly with the demo DiT.

A prompt is split into words by :func:`rolling_forcing.procedural.prompt_words` (an unknown word raises
``ValueError`` listing the vocabulary, before any model runs); word ``i`` of the sorted vocabulary is token
``i + 1`` (0 = padding). Token embeddings plus learned positions go through a small pre-norm transformer
encoder (bidirectional, padding masked) so that a colour word can bind to the shape word after it; rows
after the last word are zero, the padded layout Wan's umT5 wrapper produces (the DiT attends to all
``text_len`` rows, no mask).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from rolling_forcing import procedural


class DemoTextEncoder(nn.Module):
    """Implements :class:`rolling_forcing.text.TextEncoder` for the demo preset.

    Args:
        text_len: rows of the output (>= the longest prompt in words; a 3-shape prompt has 16 words).
        text_dim: features per row.
        num_layers, num_heads: the transformer encoder (``text_dim % num_heads == 0``).
    """

    def __init__(self, text_len: int, text_dim: int, num_layers: int = 2, num_heads: int = 4) -> None:
        super().__init__()
        if text_len < 1 or text_dim < 1 or num_layers < 0 or num_heads < 1:
            raise ValueError(
                f"DemoTextEncoder: text_len, text_dim, num_heads must be >= 1 and num_layers >= 0, got "
                f"{text_len}, {text_dim}, {num_heads}, {num_layers}"
            )
        if text_dim % num_heads:
            raise ValueError(
                f"DemoTextEncoder: text_dim={text_dim} must be divisible by num_heads={num_heads}"
            )
        self.text_len = text_len
        self.text_dim = text_dim
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.vocab = procedural.vocabulary()
        self._index = {w: i + 1 for i, w in enumerate(self.vocab)}
        self.token_embedding = nn.Embedding(len(self.vocab) + 1, text_dim, padding_idx=0)
        self.position_embedding = nn.Parameter(0.5 * torch.randn(text_len, text_dim))
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(
                text_dim, num_heads, 2 * text_dim, dropout=0.0, batch_first=True, norm_first=True
            )
            for _ in range(num_layers)
        )
        self.norm = nn.LayerNorm(text_dim)

    def tokenize(self, prompts: str | Sequence[str]) -> torch.Tensor:
        """Token ids ``[B, text_len]`` int64 (0 = padding). Raises ``ValueError`` for an unknown word (the
        vocabulary is listed), an empty prompt or one longer than ``text_len`` words; ``TypeError`` for
        anything but a str or a non-empty sequence of str."""
        items = [prompts] if isinstance(prompts, str) else list(prompts)
        if not items or not all(isinstance(p, str) for p in items):
            raise TypeError(f"prompts must be a str or a non-empty sequence of str, got {prompts!r}")
        ids = torch.zeros(len(items), self.text_len, dtype=torch.int64)
        for row, text in enumerate(items):
            words = procedural.prompt_words(text)
            if len(words) > self.text_len:
                raise ValueError(
                    f"prompt {text!r} has {len(words)} words; the demo text encoder takes at most "
                    f"text_len={self.text_len}"
                )
            ids[row, : len(words)] = torch.tensor([self._index[w] for w in words])
        return ids

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids`` ``[B, text_len]`` int64 -> float32 ``[B, text_len, text_dim]`` (padding rows zero)."""
        if ids.dim() != 2 or ids.shape[1] != self.text_len or ids.dtype != torch.int64:
            raise ValueError(
                f"ids must be int64 [B, text_len={self.text_len}], got {ids.dtype} {tuple(ids.shape)}"
            )
        pad = ids == 0
        x = self.token_embedding(ids) + self.position_embedding
        for layer in self.layers:
            x = layer(x, src_key_padding_mask=pad)
        return self.norm(x) * (~pad).unsqueeze(-1).to(x.dtype)

    @torch.no_grad()
    def encode(self, prompts: str | Sequence[str]) -> torch.Tensor:
        """``B`` prompts -> float32 ``[B, text_len, text_dim]`` (see :meth:`tokenize` for the errors)."""
        return self(self.tokenize(prompts))


__all__ = ["DemoTextEncoder"]
