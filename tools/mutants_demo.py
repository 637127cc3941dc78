"""Curated mutants of the demo model's chain rollout and its measuring tool
(rolling_forcing/demo/train_stage3.py, perf/demo_chain.py); joined to tools/mutants.py's list."""

from __future__ import annotations

from tools.mutant import Mutant

_S3 = ("tests/test_demo_stage3.py",)
_CHAIN = ("tests/test_demo_chain.py",)
_STAGE3 = "rolling_forcing/demo/train_stage3.py"

DEMO_MUTANTS: tuple[Mutant, ...] = (
    Mutant("demo-chain-renoise-level", _STAGE3, "add_noise(prev[b], eps, ts[level], table)",
           "add_noise(prev[b], eps, ts[level - 1], table)", _S3,
           "a block re-enters its window noised at its previous level's timestep"),
    Mutant("demo-chain-own-context", _STAGE3,
           "                if own_context:\n                    clean[:, blk] = prev[b]\n",
           "                if own_context:\n                    pass\n", _S3,
           "own_context=True keeps the given context instead of the stream's own outputs"),
    Mutant("demo-chain-x0-sigma", _STAGE3, "            - pipe_cfg.sigmas[level] * flow",
           "            - pipe_cfg.sigmas[-1] * flow", _S3,
           "every window block's x0 uses the last level's sigma"),
    Mutant("demo-chain-target-sign", _STAGE3, "return (window.x[:, lo:] - x0) / sigma",
           "return (x0 - window.x[:, lo:]) / sigma", _S3,
           "the stage-3 flow target points away from the true latent"),
    Mutant("demo-chain-tail-pick", _STAGE3, "n_tail = pipe_cfg.window_blocks - 1",
           "n_tail = pipe_cfg.window_blocks", _S3,
           "one full window is counted as a tail window (never drawn as a main one)"),
    Mutant("demo-chain-teacher-truth", "perf/demo_chain.py",
           "x[:, blk] = add_noise(truth[:, blk], eps, pc.timesteps[level], table)",
           "x[:, blk] = add_noise(torch.zeros_like(truth[:, blk]), eps, pc.timesteps[level], table)", _CHAIN,
           "the teacher way's inputs carry no true latent"),
)  # fmt: skip
