"""Checks of ``rolling-forcing generate``'s options, all run before any model is built.

Every anticipated mistake raises :class:`CliError`, which the command prints as ONE line
``error: <argument>: <rule>`` and turns into exit code 2 (usage: the input is wrong) or 1 (runtime: the
input was fine but the run failed, e.g. a non-finite latent). :func:`check_generate` returns the facts the
run needs (:class:`RunPlan`); it builds nothing and imports no model code beyond the configurations.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from nki_ardiff.cli_options import GenerateOptions

MAX_SECONDS = 86_400.0
"""Longest ``--seconds`` (24 h of video): the per-chunk latency report is kept in memory (~200 bytes a
chunk), so a run is bounded; loop the command for longer streams."""

MAX_SEED = 2**63 - 2
"""Largest ``--seed``: ``torch.manual_seed`` takes a 64-bit seed and the warm-up stream uses seed + 1."""

HF_EXTRA = "pip install -e '.[hf]'"


class CliError(Exception):
    """An anticipated failure, printed as ``error: <argument>: <rule>``.

    ``exit_code``: 2 for a usage error (bad option or input file), 1 for a runtime failure.
    """

    def __init__(self, argument: str, rule: str, *, exit_code: int = 2) -> None:
        super().__init__(f"{argument}: {rule}")
        self.argument, self.rule, self.exit_code = argument, rule, exit_code


@dataclass(frozen=True)
class RunPlan:
    """What the checks established: stream length and how the initial noise is drawn."""

    num_blocks: int
    upfront: bool
    partial_path: Path


def partial_path(out: Path) -> Path:
    """Where an interrupted run keeps its video: ``demo.mp4`` -> ``demo.partial.mp4`` (same directory)."""
    return out.with_name(f"{out.stem}.partial{out.suffix}")


def _check_output(path: Path, flag: str, suffix: str) -> None:
    """``path`` is a file name with ``suffix`` whose directory accepts a new file (probed, not assumed)."""
    if path.is_dir():
        raise CliError(flag, f"{str(path)!r} is a directory; give a file name ending with {suffix}")
    if path.suffix.lower() != suffix:
        raise CliError(flag, f"must end with {suffix}, got {str(path)!r}")
    parent = path.parent
    while not parent.exists() and parent != parent.parent:  # the writer creates missing directories
        parent = parent.parent
    if not parent.is_dir():
        raise CliError(flag, f"{str(parent)!r} is not a directory, so {str(path)!r} cannot be created")
    try:  # os.access is wrong for root and read-only mounts: try what the writer will do
        with tempfile.NamedTemporaryFile(dir=parent, prefix=".rolling-forcing-probe-"):
            pass
    except OSError as exc:
        raise CliError(flag, f"cannot create a file in {str(parent)!r} ({exc.strerror or exc})") from None


def _same(a: Path, b: Path) -> bool:
    return a.resolve() == b.resolve()


def _inputs(opts: GenerateOptions) -> dict[str, Path | None]:
    return {
        "--checkpoint": opts.checkpoint,
        "--lora": opts.lora,
        "--vae": opts.vae,
        "--text-encoder": opts.text_encoder,
        "--prompt-embeds": opts.prompt_embeds,
        "--prompt-schedule": opts.prompt_schedule,
    }


def _check_inputs(opts: GenerateOptions) -> None:
    """Every input path exists (local only) and is a directory or a file as its option needs."""
    for flag, p in _inputs(opts).items():
        if p is not None and not p.exists():
            raise CliError(flag, f"{str(p)!r} does not exist (local paths only; nothing is downloaded)")
    for flag, p, want_dir in (
        ("--vae", opts.vae, True),
        ("--text-encoder", opts.text_encoder, True),
        ("--prompt-embeds", opts.prompt_embeds, False),
        ("--prompt-schedule", opts.prompt_schedule, False),
        ("--lora", opts.lora, False),
    ):
        if p is not None and p.is_dir() != want_dir:
            raise CliError(flag, f"{str(p)!r} must be a {'directory' if want_dir else 'file'}")
    if opts.prompt_embeds is not None and opts.prompt_embeds.suffix != ".safetensors":
        raise CliError("--prompt-embeds", f"must be a .safetensors file, got {str(opts.prompt_embeds)!r}")


def _check_paths(opts: GenerateOptions) -> None:
    _check_output(opts.out, "--out", ".mp4")
    part = partial_path(opts.out)
    if opts.report_json is not None:
        _check_output(opts.report_json, "--report-json", ".json")
        if _same(opts.report_json, opts.out) or _same(opts.report_json, part):
            raise CliError(
                "--report-json", f"must differ from --out ({str(opts.out)!r}): it would replace it"
            )
    _check_inputs(opts)
    for flag, p in _inputs(opts).items():
        for oflag, o in (("--out", opts.out), ("--report-json", opts.report_json)):
            if p is not None and o is not None and _same(o, p):
                raise CliError(oflag, f"must differ from {flag} ({str(p)!r}): it would overwrite the input")


def _check_numbers(opts: GenerateOptions) -> None:
    s = opts.seconds
    if not (math.isfinite(s) and s > 0):
        raise CliError("--seconds", f"must be a finite number > 0, got {s!r}")
    if s > MAX_SECONDS:
        raise CliError(
            "--seconds",
            f"at most {MAX_SECONDS:g} (24 h of video) per run, got {s:g}: the latency report keeps a row "
            "per chunk in memory",
        )
    if not 0 <= opts.seed <= MAX_SEED:
        raise CliError("--seed", f"must be in [0, 2**63 - 2], got {opts.seed}")
    if opts.guidance is not None:
        check_guidance_option(opts.guidance)
    cpus = os.cpu_count() or 1
    for flag, n in (("--threads", opts.threads), ("--cores", opts.cores)):
        if n is None:
            continue
        if n < 1:
            raise CliError(flag, f"must be >= 1, got {n}")
        if n > cpus:  # allowed (a deliberate oversubscription test), but never silently
            sys.stderr.write(
                f"warning: {flag}: {n} is more than this machine's {cpus} CPUs: they share them and every "
                "wall-clock figure (and the deadline) suffers\n"
            )


def check_guidance_option(value: float, flag: str = "--guidance") -> float:
    """``--guidance`` by :func:`rolling_forcing.config.check_guidance`'s rule, as a one-line CLI error."""
    from rolling_forcing.config import check_guidance

    try:
        return check_guidance(value, flag)
    except (TypeError, ValueError) as exc:
        raise CliError(flag, str(exc).removeprefix(f"{flag} ")) from None


def _max_blocks_for_seconds() -> int:
    from rolling_forcing.video import VideoSpec

    return VideoSpec().blocks_for_seconds(MAX_SECONDS, 3)


def _check_length(opts: GenerateOptions, num_blocks: int) -> None:
    from rolling_forcing.config import PipelineConfig
    from rolling_forcing.methods import get_method
    from rolling_forcing.video import VideoSpec

    method = get_method(opts.method)
    flag = "--blocks" if opts.blocks is not None else "--seconds"
    spec, fpb = VideoSpec(), method.frames_per_block
    if not method.sequential:
        wb = PipelineConfig().window_blocks
        if num_blocks < wb:
            min_s = spec.video_frames(wb, fpb) / spec.fps
            raise CliError(
                flag,
                f"the stream needs at least window_blocks={wb} blocks (Rolling Forcing's window schedule "
                f"breaks with fewer); got {num_blocks} blocks - ask for --seconds >= {min_s:g} or "
                f"--blocks >= {wb}",
            )
    top = method.max_blocks(opts.positions)
    if top is not None and num_blocks > top:
        top_s = spec.video_frames(top, fpb) / spec.fps
        what = (
            f"its {method.attention_frames}-frame KV cache"
            if method.absolute_limit == "cache"
            else f"the {method.rope_table_size}-position RoPE table"
        )
        fix = (
            "switch with --positions relative for longer streams"
            if method.absolute_limit != "cache"
            else "use --positions relative (the cache then rolls) for longer streams"
        )
        raise CliError(
            flag,
            f"{num_blocks} blocks exceed what --method {method.name} fits with --positions absolute: at most "
            f"{top} blocks ({top_s:g} s) fit {what}; {fix}",
        )


def noise_upfront(opts: GenerateOptions, num_blocks: int) -> bool:
    """Whether the stream's initial noise is drawn up front (the originals' RNG order) or per block.

    ``--noise auto``: up front for streams the original could run (at most ``max_blocks("absolute")``
    blocks: memory bounded by that table) and per block beyond, so memory does not grow with
    ``--seconds``. The per-block draw interleaves the initial draws with the re-noise draws, so it gives a
    different (equally distributed) stream than the up-front order: it is not bit-identical.
    """
    if opts.noise == "upfront":
        return True
    if opts.noise == "per-block":
        return False
    from rolling_forcing.methods import get_method

    top = get_method(opts.method).max_blocks("absolute")
    return top is not None and num_blocks <= top


def _importable(module: str) -> bool:
    """Whether ``module`` can be imported (found without importing it; a ``None`` entry in
    ``sys.modules`` counts as absent, as ``import`` treats it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ValueError, ImportError):
        return False


def _check_extras_and_backend(opts: GenerateOptions) -> None:
    for flag, p, mod in (
        ("--vae", opts.vae, "diffusers"),
        ("--text-encoder", opts.text_encoder, "transformers"),
    ):
        if p is not None and not _importable(mod):
            raise CliError(flag, f"needs the hf extra ({mod} is not installed): {HF_EXTRA}")
    if opts.backend == "neuron":
        from nki_kernels import ops

        try:
            ops.resolve_backend("neuron")
        except RuntimeError:
            raise CliError(
                "--backend",
                "neuron needs the AWS Neuron SDK's nki package (import nki failed or NKI_ARDIFF_BACKEND="
                "emulator forces the emulator); use --backend emulator (CPU emulator) or reference",
            ) from None


def check_demo_prompt(prompt: str, flag: str = "--prompt") -> None:
    """A prompt the demo model can draw (:func:`rolling_forcing.prompts.check_scene_prompt`: vocabulary and
    roles), else :class:`CliError` ``<flag>: demo preset: <rule and the words allowed in that role>``."""
    from rolling_forcing.config import get_preset
    from rolling_forcing.prompts import check_scene_prompt

    try:
        check_scene_prompt(prompt, get_preset("demo").text_len)
    except ValueError as exc:
        raise CliError(flag, f"demo preset: {exc}") from None


def check_demo_weights(path: Path) -> None:
    """``--checkpoint`` of the demo preset: the directory ``rolling-forcing train-demo --out`` wrote, with
    its DiT, text encoder and autoencoder (the three are trained together: a DiT file alone would be
    conditioned by the shipped text encoder and decoded by the shipped autoencoder, a silently wrong
    stream). Raises :class:`CliError` ``--checkpoint`` naming what is missing; a path that does not exist
    is left to the path checks."""
    from rolling_forcing.demo import AE_FILE, DIT_FILE, TEXT_FILE

    if not path.exists():
        return
    want = (DIT_FILE, TEXT_FILE, AE_FILE)
    rule = (
        "the demo preset takes the directory `rolling-forcing train-demo --out` wrote ("
        + ", ".join(want)
        + "): its DiT is trained with its own text encoder and decodes through its own autoencoder"
    )
    if not path.is_dir():
        raise CliError("--checkpoint", f"{str(path)!r} is a file; {rule}")
    missing = [n for n in want if not (path / n).is_file()]
    if missing:
        raise CliError("--checkpoint", f"{str(path)!r} has no {', '.join(missing)}; {rule}")


def _check_demo(opts: GenerateOptions) -> None:
    """The demo preset streams its shipped weights, or a ``train-demo`` directory given as
    ``--checkpoint`` (:func:`check_demo_weights`), with their own text encoder and decoder; its prompts
    (``--prompt`` or every prompt of ``--prompt-schedule``) follow :func:`check_demo_prompt`."""
    from rolling_forcing.prompts import parse_switch_frames, read_prompt_schedule

    if opts.use_ema:
        raise CliError(
            "--use-ema",
            "the demo preset's weights are EMA weights already (train-demo writes them); the option picks "
            "generator_ema from a Rolling Forcing training checkpoint",
        )
    if opts.checkpoint is not None:
        check_demo_weights(opts.checkpoint)
    for flag, value in (
        ("--text-encoder", opts.text_encoder),
        ("--vae", opts.vae),
        ("--lora", opts.lora),
    ):
        if value is not None:
            raise CliError(
                flag, "the demo preset has its own text encoder and decoder; use --preset tiny or mid with it"
            )
    if opts.prompt_embeds is not None:
        return
    if opts.prompt_schedule is None:
        check_demo_prompt(opts.prompt)
        return
    if not opts.prompt_schedule.is_file():  # the path checks say what is wrong with it
        return
    try:
        sw = None if opts.switch_frames is None else parse_switch_frames(opts.switch_frames)
    except ValueError as exc:
        raise CliError("--switch-frames", str(exc)) from None
    try:
        schedule = read_prompt_schedule(opts.prompt_schedule, sw)
    except (ValueError, OSError) as exc:
        raise CliError("--prompt-schedule", str(exc)) from None
    for p in schedule.prompts:
        check_demo_prompt(p, "--prompt-schedule")


def _check_sources(opts: GenerateOptions, *, typed_prompts: bool = False) -> None:
    """Where the weights, the text conditioning and the decoder come from, for the preset.
    ``typed_prompts``: the command encodes prompts as they come (``serve``: no ``--prompt-embeds``)."""
    if opts.prompt_embeds is not None and opts.text_encoder is not None:
        raise CliError("--prompt-embeds", "give at most one of --prompt-embeds and --text-encoder")
    if opts.preset == "demo":
        _check_demo(opts)
    elif opts.preset != "tiny" and opts.checkpoint is None:
        raise CliError("--checkpoint", f"preset {opts.preset!r} needs weights (random ones only for tiny)")
    if opts.preset not in ("tiny", "demo") and opts.prompt_embeds is None and opts.text_encoder is None:
        how = "--text-encoder DIR (umT5)"
        how += "" if typed_prompts else " or --prompt-embeds FILE.safetensors"
        raise CliError(
            "--text-encoder",
            f"preset {opts.preset!r} needs real text conditioning: pass {how} (seeded embeddings are only "
            "for the tiny preset)",
        )
    if opts.lora is not None and opts.checkpoint is None:
        raise CliError("--lora", "needs --checkpoint (the base weights the LoRA is merged into)")


def check_model_sources(opts: GenerateOptions, *, typed_prompts: bool = False) -> None:
    """The checks of the model's sources shared by ``generate`` and ``serve``, before any build: the
    preset, ``--checkpoint`` / ``--lora`` / ``--vae`` / ``--text-encoder`` / ``--prompt-embeds`` with it
    (the demo preset's prompt rules included), the input paths and the hf extra they need.
    ``typed_prompts``: as :func:`_check_sources`. Raises :class:`CliError` (exit code 2)."""
    from rolling_forcing.config import get_preset

    try:
        get_preset(opts.preset)
    except ValueError as exc:
        raise CliError("--preset", str(exc)) from None
    _check_sources(opts, typed_prompts=typed_prompts)
    _check_inputs(opts)
    _check_extras_and_backend(opts)


def _check_switch(opts: GenerateOptions, method: str, method_recache: str) -> None:
    """``--switch``: one of the switch modes, with a prompt schedule, a re-cache only with a method whose
    original has one, a restart only on one core."""
    from rolling_forcing.prompts import SWITCH_MODES

    if opts.switch not in SWITCH_MODES:
        raise CliError("--switch", f"must be one of {', '.join(SWITCH_MODES)}, got {opts.switch!r}")
    if opts.prompt_schedule is None:
        raise CliError("--switch", "needs --prompt-schedule (the switches it takes)")
    if opts.switch == "recache" and method_recache == "none":
        raise CliError(
            "--switch",
            f"recache: --method {method} has no KV re-cache in its original (use continue or restart)",
        )
    if opts.switch == "restart" and opts.cores != 1:
        raise CliError(
            "--switch",
            "restart: the sharded stream (--cores > 1) schedules its switches up front and has no restart",
        )


def _check_combinations(opts: GenerateOptions) -> None:
    from rolling_forcing.methods import get_method

    method = get_method(opts.method)
    _check_sources(opts)
    if opts.switch_frames is not None and opts.prompt_schedule is None:
        raise CliError("--switch-frames", "needs --prompt-schedule")
    if opts.switch is not None:
        _check_switch(opts, method.name, method.recache)
    if opts.prompt_schedule is not None and opts.prompt_embeds is not None:
        raise CliError("--prompt-schedule", "encodes its prompts: it cannot be combined with --prompt-embeds")
    if opts.compile and method.sequential:
        raise CliError(
            "--compile",
            f"generate compiles --method rolling-forcing only; drop it with --method {method.name}",
        )
    if opts.compile and opts.merged is False:
        raise CliError("--compile", "compile= applies to the merged forward only; drop --two-pass")
    if opts.merged and method.sequential and opts.cores != 1:
        raise CliError("--merged", f"with --method {method.name} runs on one core only (--cores 1)")


def check_generate(opts: GenerateOptions) -> RunPlan:
    """Run every check of ``generate`` (numbers, paths, extras, backend, combinations) before any build.

    Raises :class:`CliError` (exit code 2) naming the option and the rule. Prints one ``warning:`` line
    on stderr when ``--threads`` or ``--cores`` exceed ``os.cpu_count()``.
    """
    from rolling_forcing.config import get_preset
    from rolling_forcing.video import VideoSpec

    try:
        get_preset(opts.preset)
    except ValueError as exc:
        raise CliError("--preset", str(exc)) from None
    _check_numbers(opts)
    if opts.blocks is not None:
        top = _max_blocks_for_seconds()
        if not 1 <= opts.blocks <= top:
            raise CliError(
                "--blocks", f"must be in [1, {top}] (--seconds <= {MAX_SECONDS:g}), got {opts.blocks}"
            )
        num_blocks = opts.blocks
    else:
        num_blocks = VideoSpec().blocks_for_seconds(opts.seconds, 3)
    _check_combinations(opts)
    _check_length(opts, num_blocks)
    _check_paths(opts)
    _check_extras_and_backend(opts)
    return RunPlan(num_blocks, noise_upfront(opts, num_blocks), partial_path(opts.out))


__all__ = [
    "HF_EXTRA",
    "MAX_SECONDS",
    "CliError",
    "RunPlan",
    "check_demo_prompt",
    "check_demo_weights",
    "check_generate",
    "check_model_sources",
    "noise_upfront",
    "partial_path",
]
