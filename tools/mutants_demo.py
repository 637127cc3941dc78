"""Curated mutants of the demo model's chain rollout and its measuring tool
(rolling_forcing/demo/train_stage3.py, perf/demo_chain.py), its late windows and cut options
(train_attention.long_layout, train_dit.sample_layout / make_batch, train.train_demo) and the quality
bench's vanish metric (perf/quality/metrics.longest_vanish); joined to tools/mutants.py's list."""

from __future__ import annotations

from tools.mutant import Mutant

_S3 = ("tests/test_demo_stage3.py",)
_CHAIN = ("tests/test_demo_chain.py",)
_STAGE3 = "rolling_forcing/demo/train_stage3.py"
_LONG = ("tests/test_demo_long.py",)
_ATTN = "rolling_forcing/demo/train_attention.py"
_DIT = "rolling_forcing/demo/train_dit.py"
_METRICS = ("tests/test_quality_metrics.py",)

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
    Mutant("demo-long-working-keys", _ATTN, "            need |= {b for b, _ in p.keys}",
           "            need |= {b for b, _ in p.keys[1:]}", _LONG,
           "a late window drops the oldest key of each working block's update pass"),
    Mutant("demo-long-keep-all-early", _ATTN, "    if kept == tuple(range(e + 1)):",
           "    if len(kept) >= e:", _LONG,
           "a late window that drops one block is laid out as the full sequence"),
    Mutant("demo-long-first-window", _DIT,
           "        first = n_max  # window n_max starts at block max_clean_blocks + 1",
           "        first = n_max - 1  # window n_max starts at block max_clean_blocks + 1", _LONG,
           "late windows also draw the short stream's last full window (start block max_clean_blocks)"),
    Mutant("demo-long-last-window", _DIT, "tcfg.long_blocks + wb - 1, (), generator=gen))",
           "tcfg.long_blocks + wb - 2, (), generator=gen))", _LONG,
           "the long stream's last tail window is never drawn"),
    Mutant("demo-long-bound", _DIT, "self.long_blocks <= self.max_clean_blocks + 1:",
           "self.long_blocks < self.max_clean_blocks + 1:", _LONG,
           "a long stream with no late window (long_blocks = max_clean_blocks + 1) is accepted"),
    Mutant("demo-long-ctx-blocks", _DIT, "ctx = clips.latents[src[:, None], frames[None, : s * fpb]]",
           "ctx = clips.latents[src, : s * fpb]", _LONG,
           "a late window's clean context is read from the clip's first blocks, not its stream blocks"),
    Mutant("demo-cut-inflight-src", _DIT,
           "x0[r, lo : lo + fpb] = clips.latents[src[r], frames[lo : lo + fpb]]",
           "x0[r, lo : lo + fpb] = clips.latents[idx[r], frames[lo : lo + fpb]]", _LONG,
           "in-flight blocks of a cut come from the new prompt's clip"),
    Mutant("demo-cut-restart-offset", _DIT, "clips.latents[idx[r], (i - k) * fpb : (i - k + 1) * fpb]",
           "clips.latents[idx[r], i * fpb : (i + 1) * fpb]", _LONG,
           "after in-flight blocks the restarted video skips its first k blocks"),
    Mutant("demo-late-fraction", "rolling_forcing/demo/train.py",
           "late_dit = replace(dcfg, long_fraction=LATE_FRACTION, seed=seed + 2)",
           "late_dit = replace(dcfg, seed=seed + 2)", ("tests/test_demo_cli.py",),
           "the late stage draws no late window (and its clips stay short)"),
    Mutant("demo-vanish-run-reset", "perf/quality/metrics.py",
           "            best = max(best, run)\n        out.append(best)",
           "            best = max(best, run)\n        out.append(run)", _METRICS,
           "the vanish metric reports the final run, not the longest"),
    Mutant("demo-vanish-target", "perf/quality/metrics.py", '"vanish_frames": ("<=", 12.0),',
           '"vanish_frames": ("<=", 11.0),', _METRICS,
           "a vanish of exactly one chunk fails the target"),
    Mutant("demo-late-default-off", "rolling_forcing/demo/train.py",
           "return SMOKE_LATE if smoke else LATE_STAGE",
           "return SMOKE_LATE if smoke else Stage2Config(steps=0)",
           ("tests/test_demo_cli.py",), "train_demo without late= skips the late stage outside smoke"),
    Mutant("demo-late-smoke-off", "rolling_forcing/demo/train.py",
           "return SMOKE_LATE if smoke else LATE_STAGE",
           "return Stage2Config(steps=0) if smoke else LATE_STAGE",
           ("tests/test_demo_cli.py",), "the smoke run skips the late stage"),
    Mutant("demo-cli-late-steps-ignored", "nki_ardiff/cli_train.py",
           "replace(default_late(smoke), steps=late_steps)",
           "replace(default_late(smoke))", ("tests/test_demo_cli.py",),
           "--late-steps is accepted but not passed on"),
    Mutant("demo-cli-late-steps-check", "nki_ardiff/cli_train.py",
           "if late_steps is not None and late_steps < 0:",
           "if late_steps is not None and late_steps < -1:", ("tests/test_demo_cli.py",),
           "--late-steps -1 is accepted"),
    Mutant("bench-switch-from-ignored", "perf/bench_quality.py",
           "itertools.product(plan.switch_from, SWITCH_MODES)",
           "itertools.product(plan.prompts[:1], SWITCH_MODES)",
           ("tests/test_quality_bench.py",), "the bench's switch streams all start from the first prompt"),
)  # fmt: skip
