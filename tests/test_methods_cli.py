"""``rolling-forcing generate --method M``: every method streams a video on the tiny preset, and bad
method options are refused before any model is built."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from nki_ardiff.cli import GenerateOptions, app, command_line
from rolling_forcing.video import VideoSpec, read_video

runner = CliRunner()
BLOCKS = 7  # Self-Forcing's and CausVid's whole 21-frame cache; LongLive evicts from block 4 on


@pytest.fixture(scope="module")
def videos(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple]:
    tmp = tmp_path_factory.mktemp("methods")
    out = {}
    for m in ("rolling-forcing", "self-forcing", "causvid", "longlive"):
        vid, rep = tmp / f"{m}.mp4", tmp / f"{m}.json"
        args = [
            "generate",
            "--preset",
            "tiny",
            "--blocks",
            str(BLOCKS),
            "--out",
            str(vid),
            "--report-json",
            str(rep),
        ]
        r = runner.invoke(app, [*args, "--no-progress", "--no-warmup", "--seed", "3", "--method", m])
        assert r.exit_code == 0, r.output
        assert f"method={m}" in r.output
        out[m] = (read_video(vid).astype(float), json.loads(rep.read_text()))
    return out


@pytest.mark.parametrize("method", ["rolling-forcing", "self-forcing", "causvid", "longlive"])
def test_generate_each_method(videos: dict[str, tuple], method: str) -> None:
    video, report = videos[method]
    frames = VideoSpec().video_frames(BLOCKS, 3)
    assert video.shape == (frames, 64, 64, 3)
    assert video.std() > 1.0  # not blank
    assert report["meta"]["method"] == method
    assert [c["block"] for c in report["chunks"]] == list(range(BLOCKS))
    assert ("--method" in report["meta"]["command"]) == (method != "rolling-forcing")
    assert report["meta"]["merged"] is (method == "rolling-forcing")  # sequential methods: two-pass
    # the flag really changes the loop: each method's last block differs from every other method's (same
    # seed, same weights). Measured mean |difference| of the last 12 frames: ~70 grey levels between
    # methods with different steps, 1.66 between Self-Forcing and LongLive (same steps; LongLive's
    # 12-frame window differs from block 4 on); H.264 noise between equal streams is < 0.5 (test_cli.py)
    for other, (v, _) in videos.items():
        if other != method:
            assert float(abs(video[-12:] - v[-12:]).mean()) > 1.0, other


def test_bad_method_options_fail_before_the_model_is_built(tmp_path, monkeypatch) -> None:
    import rolling_forcing.model

    def boom(*a: object, **k: object) -> None:
        raise AssertionError("model built before the options were checked")

    monkeypatch.setattr(rolling_forcing.model.CausalWanModel, "__init__", boom)
    base = ["generate", "--preset", "tiny", "--out", str(tmp_path / "x.mp4"), "--no-progress"]
    cases = [
        (["--method", "self-forcing", "--blocks", "8"], "at most 7 blocks"),
        (["--method", "causvid", "--blocks", "5", "--compile"], "--compile"),
        (["--method", "longlive", "--blocks", "5", "--merged", "--cores", "2"], "--cores 1"),
    ]
    for extra, msg in cases:
        r = runner.invoke(app, [*base, *extra])
        assert r.exit_code == 2 and msg in r.output, r.output
    r = runner.invoke(app, [*base, "--method", "diffusion-forcing"])
    assert r.exit_code == 2 and "diffusion-forcing" in r.output  # typer's choice check
    assert not (tmp_path / "x.mp4").exists()
    # relative positions lift Self-Forcing's cache limit: the command passes validation (fails at the build)
    r = runner.invoke(app, [*base, "--method", "self-forcing", "--blocks", "8", "--positions", "relative"])
    assert isinstance(r.exception, AssertionError)


def test_command_line_records_the_method(tmp_path) -> None:
    assert "--method" not in command_line(GenerateOptions(out=tmp_path / "a.mp4", blocks=5))
    cmd = command_line(GenerateOptions(out=tmp_path / "a.mp4", blocks=5, method="longlive"))
    assert cmd.endswith("--method longlive")


def test_generate_longlive_base_plus_lora(tmp_path) -> None:
    """--checkpoint longlive_base.pt --lora lora.pt: the merged weights stream (and change the video)."""
    import torch

    from rolling_forcing.config import get_preset
    from rolling_forcing.model import CausalWanModel
    from tests.test_method_checkpoints import _peft_lora

    model = CausalWanModel(get_preset("tiny")).init_random(1)
    base, lora = tmp_path / "longlive_base.pt", tmp_path / "lora.pt"
    torch.save({"generator": {f"model.{k}": v for k, v in model.state_dict().items()}}, base)
    torch.save({"generator_lora": _peft_lora(model)}, lora)
    vids, reps = [], []
    for extra in ([], ["--lora", str(lora)]):
        out, rep = tmp_path / f"v{len(extra)}.mp4", tmp_path / f"r{len(extra)}.json"
        args = [
            "generate",
            "--preset",
            "tiny",
            "--blocks",
            "5",
            "--method",
            "longlive",
            "--checkpoint",
            str(base),
            "--out",
            str(out),
        ]
        r = runner.invoke(app, [*args, "--report-json", str(rep), "--no-progress", "--no-warmup", *extra])
        assert r.exit_code == 0, r.output
        vids.append(read_video(out).astype(float))
        reps.append(json.loads(rep.read_text())["meta"])
    assert "LoRA" in reps[1]["weights"] and "LoRA" not in reps[0]["weights"]
    assert reps[1]["command"].count("--lora") == 1
    assert float(abs(vids[0] - vids[1]).mean()) > 1.0  # H.264 noise of equal streams < 0.5 (test_cli.py)
    r = runner.invoke(
        app,
        [
            "generate",
            "--preset",
            "tiny",
            "--blocks",
            "5",
            "--lora",
            str(lora),
            "--out",
            str(tmp_path / "x.mp4"),
        ],
    )
    assert r.exit_code == 2 and "error: --lora: needs --checkpoint" in r.output


def test_generate_sequential_method_on_2_cores(tmp_path) -> None:
    """--cores 2 streams a sequential method through the sharded driver: the same video as one core."""
    vids = []
    for cores in ("1", "2"):
        out = tmp_path / f"c{cores}.mp4"
        args = [
            "generate",
            "--preset",
            "tiny",
            "--blocks",
            "4",
            "--method",
            "causvid",
            "--out",
            str(out),
            "--cores",
            cores,
        ]
        r = runner.invoke(app, [*args, "--no-progress", "--no-warmup"])
        assert r.exit_code == 0, r.output
        vids.append(read_video(out).astype(float))
    # latents agree within 1e-5 (tests/test_sharding_methods.py); H.264 noise of equal streams < 0.5
    assert float(abs(vids[0] - vids[1]).mean()) < 0.5
