"""Checks of a sharded stream's inputs, run before any rank starts: the prompt-switch schedule
(:func:`check_prompts`) and the sharding plan against the model and the pipeline (:func:`check_plan`)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from rolling_forcing.config import ModelConfig, PipelineConfig
from rolling_forcing.driver import num_calls
from rolling_forcing.methods import StreamMethod, get_method
from rolling_forcing.model import CausalWanModel
from sharding.plan import ShardingPlan

__all__ = ["PromptSchedule", "check_plan", "check_prompts"]

PromptSchedule = Mapping[int, tuple[torch.Tensor, bool]]
"""Prompt switches of a stream: window index -> (``text_embeds [B, L<=text_len, text_dim]``, recache)."""


def check_prompts(
    model: CausalWanModel,
    pipe_cfg: PipelineConfig,
    prompts: PromptSchedule,
    batch: int,
    num_blocks: int,
    method: StreamMethod | None = None,
) -> None:
    """Validate a prompt schedule for a stream of ``num_blocks`` blocks and batch ``batch``.

    Windows are the stream's calls (:func:`rolling_forcing.driver.stream_plans`); a sequential
    ``method``'s switch must fall on the first step of a block (``window % steps == 0``).

    Raises ``ValueError`` naming the window for a window outside ``[0, num_windows)`` or inside a block,
    embeddings of the wrong shape or batch, and ``TypeError`` for a window that is not an int or a recache
    that is not a bool.
    """
    meth = get_method("rolling-forcing" if method is None else method)
    nw = num_calls(meth, pipe_cfg, num_blocks)
    for w, (emb, recache) in prompts.items():
        if isinstance(w, bool) or not isinstance(w, int):
            raise TypeError(f"prompt switch window must be an int, got {type(w).__name__}")
        if not 0 <= w < nw:
            raise ValueError(f"prompt switch window={w} is outside the stream's windows [0, {nw})")
        if recache is True and meth.recache == "none":
            raise ValueError(f"recache=True at window {w}: method {meth.name!r} has no KV re-cache")
        if meth.sequential and w % meth.steps:
            raise ValueError(
                f"prompt switch window={w} falls inside a block of method {meth.name!r}: switches start a "
                f"block (window = block x {meth.steps})"
            )
        if not isinstance(recache, bool):
            raise TypeError(
                f"recache of the switch at window {w} must be a bool, got {type(recache).__name__}"
            )
        model.check_context(emb)
        if emb.shape[0] != batch:
            raise ValueError(
                f"prompt of the switch at window {w} has batch {emb.shape[0]} != stream batch {batch}"
            )


def check_plan(p: ShardingPlan, model_cfg: ModelConfig, pipe_cfg: PipelineConfig) -> None:
    """Raise ``ValueError`` when plan ``p`` does not fit the model's heads or a block has fewer tokens
    than the plan has ranks (the cache-update pass gives every rank at least one token)."""
    if p.num_heads != model_cfg.num_heads:
        raise ValueError(f"plan is for num_heads={p.num_heads}, the model has {model_cfg.num_heads} heads")
    t = pipe_cfg.tokens_per_block(model_cfg)
    if t < p.world_size:
        raise ValueError(
            f"a block has {t} tokens but the plan has {p.world_size} ranks: the cache-update pass (one "
            "block) needs at least one token per rank; use fewer cores"
        )
