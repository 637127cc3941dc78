"""Curated mutants of the restarting prompt switch (``set_prompt(..., restart=True)``: the pipeline's
segments, ``ShiftedNoise``, the served page's mode); joined to tools/mutants.py's list."""

from __future__ import annotations

from tools.mutant import Mutant

_R = ("tests/test_restart.py",)
_PIPE = "rolling_forcing/pipeline.py"

RESTART_MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "restart-noise-offset",
        "rolling_forcing/stream.py",
        "        b = self.offset + block\n",
        "        b = self.offset + block + 1\n",
        _R,
        "a restarted block takes the initial noise of the block after it",
    ),
    Mutant(
        "restart-noise-unshifted",
        _PIPE,
        "seg_noise = noise if base is None else ShiftedNoise(base, offset)",
        "seg_noise = noise if base is None else ShiftedNoise(base, 0)",
        _R,
        "the restarted stream replays the first segment's initial noise",
    ),
    Mutant(
        "restart-as-continue",
        _PIPE,
        "            self._pending_prompt, self._pending_restart = None, batch\n",
        "            self._pending_prompt, self._pending_restart = (batch, False), None\n",
        _R,
        "restart=True silently continues the stream under the new prompt",
    ),
    Mutant(
        "restart-block-numbers",
        _PIPE,
        "                    offset, calls = block + 1, calls + chunk.window + 1\n",
        "                    offset, calls = chunk.block + 1, calls + chunk.window + 1\n",
        _R,
        "a second restart numbers its blocks from the first segment's count (blocks repeat)",
    ),
    Mutant(
        "restart-short-tail",
        _PIPE,
        "            seg_blocks = max(num_blocks - offset, self._min_blocks())\n",
        "            seg_blocks = num_blocks - offset\n",
        _R,
        "a restart less than a window before the end asks for a stream shorter than a window",
    ),
    Mutant(
        "restart-page-ignored",
        "rolling_forcing/serve/session.py",
        "sw.applied_block = self.stream.set_prompt(self._pending_emb, sw.recache, sw.restart)",
        "sw.applied_block = self.stream.set_prompt(self._pending_emb, sw.recache)",
        ("tests/test_serve.py",),
        "the served page's restart continues the stream instead",
    ),
    Mutant(
        "restart-cost-counted",
        "rolling_forcing/serve/session.py",
        "            if out.block > 0 and not (last.restart and out.block == last.applied_block):\n",
        "            if out.block > 0:\n",
        ("tests/test_serve.py",),
        "the warm-up chunk after a restart counts as a steady cost: admission turns viewers away",
    ),
)
