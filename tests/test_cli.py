"""The ``rolling-forcing`` CLI: generate (tiny preset, CPU, no download), plan, bench, entry points."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from nki_ardiff.cli import app
from rolling_forcing.video import VideoSpec, read_video

runner = CliRunner()


def test_generate_tiny_writes_video_and_report(tmp_path) -> None:
    out, rep = tmp_path / "demo.mp4", tmp_path / "report.json"
    blocks = 5  # the minimum stream (one full window)
    result = runner.invoke(
        app,
        [
            "generate",
            "--preset",
            "tiny",
            "--preset",
            "tiny",
            "--blocks",
            str(blocks),
            "--out",
            str(out),
            "--report-json",
            str(rep),
        ]
        + ["--no-progress", "--seed", "3"],
    )
    assert result.exit_code == 0, result.output
    spec = VideoSpec()
    frames = spec.video_frames(blocks, 3)  # 9 + 4 * 12 = 57
    video = read_video(out)
    assert video.shape == (frames, 8 * 8, 8 * 8, 3)  # tiny latents 8x8, spatial stride 8
    assert video.std() > 1.0  # not a blank video
    data = json.loads(rep.read_text())
    assert data["interrupted"] is False and data["error"] is None and data["signal"] is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo.mp4", "report.json"]  # no temporary left
    s = data["summary"]
    assert s["kind"] == "measured"
    assert s["chunks"] == blocks and s["video_frames"] == frames
    assert s["deadline_s"] == pytest.approx(0.75)
    assert [c["block"] for c in data["chunks"]] == list(range(blocks))
    assert [c["video_frames"] for c in data["chunks"]] == [9, 12, 12, 12, 12]
    ready = [c["ready_s"] for c in data["chunks"]]
    assert ready == sorted(ready) and s["time_to_first_frame_s"] == pytest.approx(ready[0])
    assert 0 <= s["deadline_misses"] <= blocks - 1
    assert "time to first frame" in result.output and "deadline misses" in result.output


def test_generate_is_deterministic_per_seed(tmp_path) -> None:
    outs = []
    for i in range(2):
        out = tmp_path / f"d{i}.mp4"
        r = runner.invoke(
            app,
            [
                "generate",
                "--preset",
                "tiny",
                "--blocks",
                "5",
                "--out",
                str(out),
                "--no-progress",
                "--seed",
                "7",
            ],
        )
        assert r.exit_code == 0, r.output
        outs.append(read_video(out))
    assert (outs[0] == outs[1]).all()


def test_generate_rejects_too_few_blocks(tmp_path) -> None:
    r = runner.invoke(
        app,
        ["generate", "--preset", "tiny", "--seconds", "1", "--out", str(tmp_path / "x.mp4"), "--no-progress"],
    )
    assert r.exit_code == 2
    assert "at least window_blocks=5 blocks" in r.output
    assert not (tmp_path / "x.mp4").exists()


def test_generate_rejects_wrong_prompt_embeds(tmp_path) -> None:
    import torch
    from safetensors.torch import save_file

    bad = tmp_path / "e.safetensors"
    save_file({"prompt_embeds": torch.zeros(1, 7, 32)}, str(bad))
    r = runner.invoke(
        app,
        [
            "generate",
            "--preset",
            "tiny",
            "--preset",
            "tiny",
            "--blocks",
            "5",
            "--prompt-embeds",
            str(bad),
            "--out",
            str(tmp_path / "y.mp4"),
        ],
    )
    assert r.exit_code == 2
    assert "text_len=16, text_dim=32" in r.output


def test_wan_preset_needs_weights(tmp_path) -> None:
    r = runner.invoke(
        app, ["generate", "--preset", "tiny", "--preset", "wan2.1-1.3b", "--out", str(tmp_path / "z.mp4")]
    )
    assert r.exit_code == 2 and "--checkpoint" in r.output


def test_plan_prints_table() -> None:
    """``plan`` prints the planner's table for generate's stream shape (tiny preset, float32 by default)."""
    r = runner.invoke(app, ["plan", "--preset", "wan2.1-1.3b", "--cores", "8", "--dtype", "bfloat16"])
    assert r.exit_code == 0, r.output
    from rolling_forcing.config import PipelineConfig, get_preset
    from sharding.pipeline import attention_shape
    from sharding.plan import plan_table

    shape = attention_shape(get_preset("wan2.1-1.3b"), PipelineConfig(dtype="bfloat16"))
    assert r.output.strip() == plan_table(12, 8, shape=shape).strip()
    assert "-> TP4xSP2" in r.output.splitlines()[0]


@pytest.mark.parametrize(
    ("preset", "cores", "layout"), [("tiny", 2, "TP1xSP2"), ("wan2.1-1.3b", 2, "Ulysses TP2xSP1")]
)
def test_plan_names_the_layout_generate_runs(preset: str, cores: int, layout: str) -> None:
    """``plan --cores N`` and ``generate --cores N`` take the layout from the same function
    (sharding.pipeline.pipeline_plan, which ShardedRollingForcingPipeline calls): for the tiny preset's
    short window the planner prefers SP, for the 1.3B preset's long one TP (heads)."""
    from rolling_forcing.config import PipelineConfig, get_preset
    from sharding.pipeline import pipeline_plan

    r = runner.invoke(app, ["plan", "--preset", preset, "--cores", str(cores)])
    assert r.exit_code == 0, r.output
    assert r.output.splitlines()[0].split(" -> ")[1].startswith(f"{layout} (")
    assert pipeline_plan(get_preset(preset), PipelineConfig(dtype="float32"), cores).name == layout


def test_plan_bad_cores_is_one_error_line_naming_the_option() -> None:
    r = runner.invoke(app, ["plan", "--cores", "0"])
    assert r.exit_code == 2 and "--cores" in r.output and "Traceback" not in r.output


def test_dash_h_and_version() -> None:
    from importlib.metadata import version

    for args in (["-h"], ["plan", "-h"], ["generate", "--preset", "tiny", "-h"], ["bench", "-h"]):
        r = runner.invoke(app, args)
        assert r.exit_code == 0 and "Usage:" in r.output, (args, r.output)
    assert runner.invoke(app, ["plan", "-h"]).output == runner.invoke(app, ["plan", "--help"]).output
    r = runner.invoke(app, ["--version"])
    assert r.exit_code == 0 and r.output.strip() == f"rolling-forcing (nki-ardiff) {version('nki-ardiff')}"


def test_bench_missing_module_is_a_clear_error(monkeypatch) -> None:
    import importlib

    real = importlib.import_module

    def fake(name: str, *a, **k):
        if name == "perf.e2e":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real(name, *a, **k)

    monkeypatch.setattr(importlib, "import_module", fake)
    r = runner.invoke(app, ["bench", "e2e"])
    assert r.exit_code == 2 and "perf.e2e is not available" in r.output


def test_bench_e2e_model_setup_runs_without_diffusers() -> None:
    """bench e2e's model setup (preset at the VAE's stride, VAE layer shapes) with diffusers hidden: the
    Wan VAE comes from the carried table, so the 1.3B preset at 480x832 gives latent 60x104 (stride 8)."""
    code = (
        "import sys; sys.modules['diffusers'] = None\n"
        "from perf.e2e.run import _model\n"
        "from perf.footprint import vae_probe\n"
        "m = _model('wan2.1-1.3b', 480, 832)\n"
        "p = vae_probe(m.latent_height, m.latent_width, 3)\n"
        "print(m.latent_height, m.latent_width, p.steady[-1].out_shape, p.decoder_params)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    # the decoder's last conv emits RGB at 8x the latent size, 4 frames per steady latent frame
    assert r.stdout.split(maxsplit=2)[:2] == ["60", "104"]
    assert "(1, 3, 4, 480, 832)" in r.stdout


def test_python_dash_m_entry_point() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "nki_ardiff", "--help"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0 and "generate" in r.stdout and "plan" in r.stdout


def test_generate_with_local_weights_vae_and_embeds(tmp_path) -> None:
    """The real-weights path on tiny shapes: diffusers-layout checkpoint, local AutoencoderKLWan, embeds."""
    import torch
    from diffusers import AutoencoderKLWan

    from rolling_forcing.checkpoint import save_safetensors, wan_to_diffusers
    from rolling_forcing.config import get_preset
    from rolling_forcing.model import CausalWanModel
    from rolling_forcing.text import SeededTextEncoder

    cfg = get_preset("tiny")
    ckpt = tmp_path / "dit.safetensors"
    save_safetensors(wan_to_diffusers(CausalWanModel(cfg).init_random(5).state_dict()), ckpt)
    torch.manual_seed(0)
    vae = AutoencoderKLWan(base_dim=8, z_dim=cfg.out_channels, dim_mult=[1, 2, 2, 2], num_res_blocks=1)
    vae.save_pretrained(str(tmp_path / "vae"))
    embeds = tmp_path / "embeds.safetensors"
    save_safetensors({"prompt_embeds": SeededTextEncoder(cfg.text_len, cfg.text_dim).encode(["x"])}, embeds)
    out, rep = tmp_path / "real.mp4", tmp_path / "real.json"
    r = runner.invoke(
        app,
        [
            "generate",
            "--preset",
            "tiny",
            "--blocks",
            "5",
            "--checkpoint",
            str(ckpt),
            "--vae",
            str(tmp_path),
            "--prompt-embeds",
        ]
        + [str(embeds), "--out", str(out), "--report-json", str(rep), "--no-progress", "--no-warmup"],
    )
    assert r.exit_code == 0, r.output
    assert "diffusers key layout" in r.output and "AutoencoderKLWan" in r.output
    assert read_video(out).shape == (57, 64, 64, 3)
    meta = json.loads(rep.read_text())["meta"]
    assert meta["warmup"] is False and "dit.safetensors" in meta["weights"]


def test_report_records_a_reproducing_command(tmp_path) -> None:
    from nki_ardiff.cli import GenerateOptions, command_line

    opts = GenerateOptions(out=tmp_path / "a b.mp4", blocks=6, prompt="two words", warmup=False)
    cmd = command_line(opts)
    assert cmd.startswith("rolling-forcing generate --preset demo --blocks 6 --prompt 'two words'")
    assert cmd.endswith("--no-warmup") and f"'{tmp_path / 'a b.mp4'}'" in cmd


def test_generate_merged_and_two_pass_flags(tmp_path) -> None:
    """--merged/--two-pass choose the forward, are recorded in the JSON report and give the same stream."""
    videos, metas = {}, {}
    for flag in ("--merged", "--two-pass"):
        out, rep = tmp_path / f"{flag[2:]}.mp4", tmp_path / f"{flag[2:]}.json"
        args = [
            "generate",
            "--preset",
            "tiny",
            "--blocks",
            "5",
            "--out",
            str(out),
            "--report-json",
            str(rep),
            "--no-progress",
        ]
        r = runner.invoke(app, [*args, "--no-warmup", flag])
        assert r.exit_code == 0, r.output
        videos[flag], metas[flag] = read_video(out).astype(float), json.loads(rep.read_text())["meta"]
    assert metas["--merged"]["merged"] is True and metas["--merged"]["merged_option"] is True
    assert metas["--two-pass"]["merged"] is False and metas["--two-pass"]["merged_option"] is False
    assert metas["--merged"]["compile"] is False
    assert metas["--merged"]["command"].endswith("--merged")
    assert metas["--two-pass"]["command"].endswith("--two-pass")
    # latents agree to ~1e-6 (tests/test_merged.py); after uint8 rounding and H.264 the videos agree to
    # a fraction of one grey level on average (a real mismatch is tens of levels: the frames are noise)
    assert float(abs(videos["--merged"] - videos["--two-pass"]).mean()) < 0.5


def test_generate_default_mode_and_bad_combinations(tmp_path) -> None:
    rep = tmp_path / "r.json"
    args = [
        "generate",
        "--preset",
        "tiny",
        "--blocks",
        "5",
        "--out",
        str(tmp_path / "a.mp4"),
        "--no-progress",
        "--no-warmup",
    ]
    r = runner.invoke(app, [*args, "--report-json", str(rep)])
    assert r.exit_code == 0, r.output
    meta = json.loads(rep.read_text())["meta"]
    assert meta["merged"] is True and meta["merged_option"] is None  # the pipeline default (reference)
    assert "--merged" not in meta["command"] and "--two-pass" not in meta["command"]
    r = runner.invoke(app, [*args, "--two-pass", "--compile"])
    assert r.exit_code == 2 and "compile= applies to the merged forward only" in r.output
    r = runner.invoke(app, [*args, "--cores", "2", "--two-pass", "--compile"])  # before any rank is spawned
    assert r.exit_code == 2 and "compile= applies to the merged forward only" in r.output


def test_command_line_records_forward_mode(tmp_path) -> None:
    from nki_ardiff.cli import GenerateOptions, command_line

    base = GenerateOptions(out=tmp_path / "a.mp4", blocks=6)
    assert "--merged" not in command_line(base) and "--compile" not in command_line(base)
    cmd = command_line(GenerateOptions(out=tmp_path / "a.mp4", blocks=6, merged=True, compile=True))
    assert cmd.endswith("--merged --compile")
    assert command_line(GenerateOptions(out=tmp_path / "a.mp4", blocks=6, merged=False)).endswith(
        "--two-pass"
    )


@pytest.mark.slow
def test_generate_compiled_merged(tmp_path) -> None:
    """--compile: inductor-compiled merged forward (~25 s of compilation on CPU, hence slow)."""
    rep = tmp_path / "c.json"
    args = [
        "generate",
        "--preset",
        "tiny",
        "--blocks",
        "6",
        "--out",
        str(tmp_path / "c.mp4"),
        "--no-progress",
    ]
    r = runner.invoke(app, [*args, "--compile", "--report-json", str(rep)])
    assert r.exit_code == 0, r.output
    meta = json.loads(rep.read_text())["meta"]
    assert meta["compile"] is True and meta["merged"] is True and meta["command"].endswith("--compile")


def test_help_fits_80_columns_and_names_the_backend_env_var() -> None:
    """Every help screen is at most 80 columns wide (max_content_width, whatever the terminal); the
    backend flag shows NKI_ARDIFF_BACKEND; --preset lists every preset of rolling_forcing.config."""
    from rolling_forcing.config import PRESETS

    # a real process on a 200-column "terminal" (CliRunner's output is not measured against COLUMNS)
    code = (
        "import sys\nfrom nki_ardiff.cli import main\n"
        "for args in (['-h'], ['generate', '-h'], ['plan', '-h'], ['bench', '-h'], ['train-demo', '-h']):\n"
        "    try:\n        main(args)\n"
        "    except SystemExit as e:\n        assert e.code == 0, (args, e.code)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "NKI_ARDIFF_BACKEND"} | {"COLUMNS": "200"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("Usage: rolling-forcing") == 5
    wide = [line for line in r.stdout.splitlines() if len(line) > 80]
    assert wide == [], wide
    text = runner.invoke(app, ["generate", "--preset", "tiny", "-h"]).output
    assert "[env var: NKI_ARDIFF_BACKEND" in text
    assert f"--preset <{'|'.join(['demo', 'tiny', 'micro', 'mid', 'wan2.1-1.3b'])}>" in text
    from nki_ardiff.cli_options import Preset

    assert {p.value for p in Preset} == set(PRESETS)


def test_backend_env_var_is_the_flag_default(monkeypatch, tmp_path) -> None:
    """NKI_ARDIFF_BACKEND sets --backend's default as it sets the library's; the flag wins over it."""
    import nki_ardiff.cli as cli

    seen = []
    monkeypatch.setattr(cli, "run_generate", lambda opts, echo: seen.append(opts.backend))
    out = ["--out", str(tmp_path / "x.mp4")]
    monkeypatch.setenv("NKI_ARDIFF_BACKEND", "emulator")
    assert runner.invoke(app, ["generate", "--preset", "tiny", *out]).exit_code == 0
    assert runner.invoke(app, ["generate", "--preset", "tiny", "--backend", "reference", *out]).exit_code == 0
    monkeypatch.delenv("NKI_ARDIFF_BACKEND")
    assert runner.invoke(app, ["generate", "--preset", "tiny", *out]).exit_code == 0
    assert seen == ["emulator", "reference", "reference"]


def test_progress_bars_only_when_asked_or_on_a_terminal_and_quiet(tmp_path) -> None:
    """Not a terminal (CliRunner's stderr): no bar by default; --progress forces the warm-up and stream
    bars (tqdm, on stderr) and the build phases; --quiet prints only the result line."""
    base = ["generate", "--preset", "tiny", "--blocks", "5", "--out", str(tmp_path / "p.mp4")]
    r = runner.invoke(app, base)
    assert r.exit_code == 0 and "streaming" not in r.stderr and "warm-up:" not in r.stderr
    assert "per-chunk latency" in r.stdout
    r = runner.invoke(app, [*base, "--progress"])
    assert r.exit_code == 0, r.output
    assert "streaming: 100%" in r.stderr and "warm-up: 100%" in r.stderr
    assert "building the tiny model ..." in r.stderr
    r = runner.invoke(app, [*base, "--quiet", "--progress"])
    assert r.exit_code == 0 and r.stderr == ""
    assert r.stdout.strip().splitlines() == [f"video written to {tmp_path / 'p.mp4'} (57 frames)"]


def test_make_bench_targets_leave_tracked_results_alone() -> None:
    """`make bench|e2e|bench-pipeline|bench-long-stream` print only or write under build/ (untracked);
    UPDATE=1 regenerates perf/results. Read from `make -n` (what make would run)."""
    import shutil
    from pathlib import Path

    if shutil.which("make") is None:
        pytest.fail("make is not installed: the Makefile targets cannot be checked")
    root = Path(__file__).resolve().parents[1]

    def dry(*args: str) -> list[str]:
        r = subprocess.run(["make", "-n", "-C", str(root), *args], capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        return [line for line in r.stdout.splitlines() if "-m perf." in line]

    assert dry("bench", "e2e", "bench-pipeline", "bench-long-stream") == [
        "python -m perf.bench_kernels ",
        "python -m perf.e2e --out-dir build/perf",
        "python -m perf.bench_pipeline ",
        "python -m perf.bench_long_stream ",
    ]
    assert dry("bench", "e2e", "UPDATE=1") == [
        "python -m perf.bench_kernels --save",
        "python -m perf.e2e --save",
    ]
    ignored = subprocess.run(["git", "-C", str(root), "check-ignore", "-q", "build/perf/REPORT_quick.md"])
    assert ignored.returncode == 0
