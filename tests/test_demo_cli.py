"""``train-demo`` and the demo preset of ``generate``: options checked first (one-line errors), the smoke
run writes weights that ``load_demo`` streams."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from nki_ardiff.cli import app

runner = CliRunner()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--seed", "-1"], "error: --seed: must be >= 0, got -1"),
        (["--threads", "0"], "error: --threads: must be >= 1, got 0"),
        (["--autoencoder", "nope.safetensors"], "error: --autoencoder: 'nope.safetensors' does not exist"),
        (
            ["--prompt-speed", "0"],
            "error: --prompt-speed: must be a finite number > 0 (pixels/frame), got 0.0",
        ),
        (["--prompt-speed", "-0.5"], "error: --prompt-speed: must be a finite number > 0"),
        (["--prompt-speed", "inf"], "error: --prompt-speed: must be a finite number > 0"),
        (["--late-steps", "-1"], "error: --late-steps: must be >= 0 (0: no late stage), got -1"),
        (
            ["--prompt-sizes", "circle=8,square=9"],
            "error: --prompt-sizes: must give a size for each of circle, square, triangle (no other key)",
        ),
        (
            ["--prompt-sizes", "circle=8,square=20,triangle=9"],
            "error: --prompt-sizes: the square's size must be a finite number in (0, 16] (pixels), got 20.0",
        ),
        (
            ["--prompt-sizes", "circle:8"],
            "error: --prompt-sizes: must be circle=PIXELS,square=PIXELS,triangle=",
        ),
    ],
)
def test_train_demo_option_errors(args: list[str], message: str, tmp_path) -> None:
    r = runner.invoke(app, ["train-demo", "--out", str(tmp_path / "w"), *args])
    assert r.exit_code == 2 and message in r.output, r.output
    assert not (tmp_path / "w").exists()  # checked before anything ran


def test_train_demo_out_must_be_a_directory(tmp_path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    r = runner.invoke(app, ["train-demo", "--out", str(f)])
    assert r.exit_code == 2 and "error: --out:" in r.output and "not a directory" in r.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--prompt", "a pink circle"],
            "error: --prompt: demo preset: prompt word 'pink' is not in the vocabulary",
        ),
        (["--vae", "."], "error: --vae: the demo preset has its own text encoder and decoder"),
        (
            ["--checkpoint", "pyproject.toml"],
            "error: --checkpoint: 'pyproject.toml' is a file; the demo preset takes the directory "
            "`rolling-forcing train-demo --out` wrote (dit.safetensors, text_encoder.safetensors, "
            "autoencoder.safetensors): its DiT is trained with its own text encoder and decodes through its "
            "own autoencoder",
        ),
        (
            ["--checkpoint", "docs"],
            "error: --checkpoint: 'docs' has no dit.safetensors, text_encoder.safetensors, "
            "autoencoder.safetensors; the demo preset takes the directory",
        ),
        (["--use-ema"], "error: --use-ema: the demo preset's weights are EMA weights already"),
    ],
)
def test_generate_demo_option_errors(args: list[str], message: str, tmp_path) -> None:
    r = runner.invoke(app, ["generate", "--blocks", "5", "--out", str(tmp_path / "a.mp4"), *args])
    assert r.exit_code == 2 and message in r.output, r.output


def test_generate_demo_checkpoint_names_the_missing_files(tmp_path, monkeypatch) -> None:
    """A directory with the DiT but not its text encoder or autoencoder is refused naming those two, before
    any model is loaded."""
    import rolling_forcing.demo as demo_mod

    def boom(*a: object, **k: object) -> None:
        raise AssertionError("the demo model was loaded before the options were checked")

    monkeypatch.setattr(demo_mod, "load_demo", boom)
    w = tmp_path / "w"
    w.mkdir()
    (w / "dit.safetensors").write_bytes(b"")
    r = runner.invoke(app, ["generate", "--checkpoint", str(w), "--out", str(tmp_path / "a.mp4")])
    assert r.exit_code == 2, r.output
    assert r.output.startswith(
        f"error: --checkpoint: '{w}' has no text_encoder.safetensors, autoencoder.safetensors; "
    ), r.output


def test_smoke_training_writes_weights_load_demo_streams(tmp_path) -> None:
    from rolling_forcing.config import PipelineConfig
    from rolling_forcing.demo import load_demo
    from rolling_forcing.pipeline import RollingForcingPipeline

    out = tmp_path / "w"
    r = runner.invoke(app, ["train-demo", "--smoke", "--out", str(out), "--no-progress", "--threads", "1"])
    assert r.exit_code == 0, r.output
    names = {"autoencoder.safetensors", "dit.safetensors", "text_encoder.safetensors", "losses.png"}
    assert names <= {p.name for p in out.iterdir()}
    log = json.loads((out / "train_log.json").read_text())
    assert (
        log["smoke"] is True
        and log["threads"] == 1
        and set(log["seconds_measured"])
        == {
            "autoencoder",
            "clips",
            "dit",
            "stage2",
            "late",
        }
        and log["stage2"]["steps"] == 2
        and log["late"]["steps"] == 2  # smoke runs every stage, the late one included
    )
    demo = load_demo(out)
    emb = demo.text_encoder.encode("a red circle bouncing on a gray background")
    pipe = RollingForcingPipeline(demo.model, demo.model_cfg, PipelineConfig())
    chunks = list(pipe.stream(emb, 5, generator=torch.Generator().manual_seed(0)))
    video = demo.decoder.decode(chunks[0].latents)
    assert video.shape == (1, 9, 3, 64, 64) and bool(torch.isfinite(video).all())


@pytest.mark.parametrize("speed", [0, -1.0, float("inf"), True])
def test_train_demo_refuses_a_bad_prompt_speed_before_any_work(speed: object, tmp_path) -> None:
    from rolling_forcing.demo.train import train_demo

    with pytest.raises(ValueError, match="prompt_speed must be a finite number > 0"):
        train_demo(tmp_path / "w", prompt_speed=speed, smoke=True)  # type: ignore[arg-type]
    assert not (tmp_path / "w").exists()


def test_train_demo_late_stage_trains_on_long_clips(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The late stage (on by default; ``steps=0`` turns it off) is a third warm restart on late windows of
    long clips: it is logged with its settings and time, leaves stages 1-2 as they were (they read the
    long clips' first blocks) and changes the weights (the same run without it differs)."""
    from safetensors.torch import load_file

    from rolling_forcing.demo.train import LATE_FRACTION, train_demo
    from rolling_forcing.demo.train_stage2 import Stage2Config
    from rolling_forcing.procedural import PROMPT_SIZES

    base = train_demo(tmp_path / "a", smoke=True, progress=False, threads=1, late=Stage2Config(steps=0))
    late = train_demo(tmp_path / "b", smoke=True, progress=False, threads=1)
    log_a = json.loads((base.out_dir / "train_log.json").read_text())
    log_b = json.loads((late.out_dir / "train_log.json").read_text())
    assert log_a["late"]["steps"] == 0 and log_b["late"]["steps"] == 2
    assert log_a["prompt_sizes"] == log_b["prompt_sizes"] == dict(PROMPT_SIZES)
    assert log_b["late"]["long_fraction"] == LATE_FRACTION and log_b["late"]["long_blocks"] == 10
    assert log_b["seconds_measured"]["late"] > 0 and len(late.late_losses) == 2 and not base.late_losses
    assert late.dit_losses == base.dit_losses and late.stage2_losses == base.stage2_losses
    a, b = load_file(str(base.out_dir / "dit.safetensors")), load_file(str(late.out_dir / "dit.safetensors"))
    assert a.keys() == b.keys() and any(not torch.equal(a[k], b[k]) for k in a)


def test_cli_late_steps_default_is_the_recipe() -> None:
    """``train-demo --late-steps`` defaults to the recipe's late stage (the CLI keeps the number without
    importing torch); ``--late-steps 0`` is the recipe without it."""
    from nki_ardiff.cli_train import LATE_STEPS
    from rolling_forcing.demo.train import LATE_STAGE

    assert LATE_STEPS == LATE_STAGE.steps > 0


def test_cli_late_steps_zero_turns_the_late_stage_off(tmp_path) -> None:
    """``--late-steps 0`` drops the late stage; ``--prompt-sizes`` reaches the clips: the run equals
    ``train_demo`` given the same table (its stage-1 losses) and differs from the default sizes'."""
    from rolling_forcing.demo.train import train_demo
    from rolling_forcing.demo.train_stage2 import Stage2Config

    out = tmp_path / "w"
    args = [
        "train-demo",
        "--smoke",
        "--out",
        str(out),
        "--no-progress",
        "--threads",
        "1",
        "--late-steps",
        "0",
    ]
    r = runner.invoke(app, [*args, "--prompt-sizes", "circle=8,square=9,triangle=9"])
    assert r.exit_code == 0, r.output
    log = json.loads((out / "train_log.json").read_text())
    assert log["late"]["steps"] == 0 and log["stage2"]["steps"] == 2 and "late 0 s" in r.output
    assert log["prompt_sizes"] == {"circle": 8.0, "square": 9.0, "triangle": 9.0}
    off = Stage2Config(steps=0)
    same = train_demo(
        tmp_path / "s", smoke=True, progress=False, threads=1, late=off, prompt_sizes=log["prompt_sizes"]
    )
    default = train_demo(tmp_path / "d", smoke=True, progress=False, threads=1, late=off)
    assert log["final_dit_loss_mean_last_100"] == sum(same.dit_losses) / len(same.dit_losses)
    assert same.dit_losses != default.dit_losses


def test_train_demo_runs_the_late_stage_by_default_outside_smoke(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Without ``smoke`` and without ``late``, ``train_demo`` runs :data:`LATE_STAGE` (patched here to two
    steps so the run stays small; every other stage gets smoke-sized settings explicitly)."""
    from rolling_forcing.demo import train as train_mod
    from rolling_forcing.demo.train_stage2 import Stage2Config

    monkeypatch.setattr(train_mod, "LATE_STAGE", Stage2Config(steps=3, warmup_steps=1))
    ae = "rolling_forcing/demo/weights/autoencoder.safetensors"
    rep = train_mod.train_demo(
        tmp_path / "w", progress=False, threads=1, autoencoder=ae, clips=4,
        dit=train_mod.SMOKE_DIT, stage2=train_mod.SMOKE_STAGE2,
    )  # fmt: skip
    log = json.loads((rep.out_dir / "train_log.json").read_text())
    assert log["smoke"] is False and log["late"]["steps"] == 3 and len(rep.late_losses) == 3
    assert log["late"]["long_fraction"] == train_mod.LATE_FRACTION


def test_generate_demo_checkpoint_with_corrupt_weights_names_the_file(tmp_path) -> None:
    """The three files there but not readable: one line naming ``--checkpoint`` and the file, exit 2."""
    w = tmp_path / "w"
    w.mkdir()
    for name in ("dit.safetensors", "text_encoder.safetensors", "autoencoder.safetensors"):
        (w / name).write_bytes(b"")
    r = runner.invoke(app, ["generate", "--checkpoint", str(w), "--out", str(tmp_path / "a.mp4")])
    assert r.exit_code == 2, r.output
    assert r.output.startswith(
        f"error: --checkpoint: demo preset: '{w / 'dit.safetensors'}' is not a readable .safetensors file"
    ), r.output
    assert not (tmp_path / "a.mp4").exists()
