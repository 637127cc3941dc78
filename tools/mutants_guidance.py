"""Curated mutants of classifier-free guidance (rolling_forcing/guidance.py, the driver's combination, the
pipeline's doubled batch, the sharded stream's, the reference loop's guided stream and the CLI's check);
joined to tools/mutants.py's list."""

from __future__ import annotations

from tools.mutant import Mutant

_G = ("tests/test_guidance.py",)
_GUIDE = "rolling_forcing/guidance.py"

GUIDANCE_MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "guidance-sign",
        _GUIDE,
        "g = (u + scale * (c - u)).to(x0.dtype)",
        "g = (c + scale * (u - c)).to(x0.dtype)",
        _G,
        "guidance steers towards the negative prompt instead of away from it",
    ),
    Mutant(
        "guidance-one-half",
        _GUIDE,
        "    return torch.cat([g, g], dim=0)\n",
        "    return torch.cat([g, u.to(x0.dtype)], dim=0)\n",
        _G,
        "the negative half keeps its own x0: its cache drifts from the stream's",
    ),
    Mutant(
        "guidance-noise-rows",
        _GUIDE,
        "        return torch.cat([x, x], dim=0)\n\n    def upfront_blocks",
        "        return torch.cat([x, torch.randn_like(x)], dim=0)\n\n    def upfront_blocks",
        _G,
        "the negative half starts every block from other noise than the prompt half",
    ),
    Mutant(
        "guidance-interval-edge",
        _GUIDE,
        "return torch.where(sig[idx] > sigma_min, float(scale), 1.0).float()",
        "return torch.where(sig[idx] < sigma_min, float(scale), 1.0).float()",
        _G,
        "the guidance interval guides the least noisy levels instead of the noisiest",
    ),
    Mutant(
        "guidance-driver-off",
        "rolling_forcing/driver.py",
        "            if spec.guided:  # both halves",
        "            if False:  # both halves",
        _G,
        "the doubled batch is never combined: two independent streams, the prompt half yielded",
    ),
    Mutant(
        "guidance-chunk-rows",
        "rolling_forcing/driver.py",
        "out = clean[: clean.shape[0] // 2] if spec.guided else clean",
        "out = clean",
        _G,
        "a guided stream yields both halves' rows as its chunks",
    ),
    Mutant(
        "guidance-switch-not-doubled",
        "rolling_forcing/pipeline.py",
        "        batch = self._batch(text_embeds, negative_embeds)\n        if restart and",
        "        batch = text_embeds\n        if restart and",
        _G,
        "a guided stream's switch installs the prompt only (the batch no longer matches)",
    ),
    Mutant(
        "guidance-sharded-ignored",
        "sharding/rank_stream.py",
        "        if self._spec.guided:  # model_cfg",
        "        if False:  # model_cfg",
        _G,
        "the sharded stream does not double the batch for guidance",
    ),
    Mutant(
        "guidance-cli-unchecked",
        "nki_ardiff/cli_checks.py",
        "    if opts.guidance is not None:\n        check_guidance_option",
        "    if False:\n        check_guidance_option",
        ("tests/test_cli_guidance.py",),
        "generate accepts --guidance 0.5 and fails later in the pipeline with a traceback",
    ),
)
