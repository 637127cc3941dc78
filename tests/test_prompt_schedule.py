"""LongLive's prompt-schedule JSONL: parsing, the switch rule, and ``generate --prompt-schedule``."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from nki_ardiff.cli import app
from nki_ardiff.cli_options import default_switch
from rolling_forcing.prompts import PromptSchedule, parse_switch_frames, read_prompt_schedule
from rolling_forcing.video import read_video

runner = CliRunner()


def test_read_longlive_jsonl(tmp_path) -> None:
    path = tmp_path / "interactive.jsonl"
    rows = [{"prompts": ["a fox", "a fox jumps", "a fox sleeps"]}, {"prompts": ["x", "y", "z"]}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    s = read_prompt_schedule(path, parse_switch_frames("40, 80"))
    assert s == PromptSchedule(("a fox", "a fox jumps", "a fox sleeps"), (40, 80))
    # LongLive's rule: a switch fires at the first block starting at or after its frame (40 -> frame 42)
    assert s.switch_blocks(3) == (14, 27)
    assert PromptSchedule(("a", "b"), (42,)).switch_blocks(3) == (14,)
    assert s.segments(3, 20) == [(0, "a fox"), (14, "a fox jumps")]
    assert read_prompt_schedule(path, (3, 6), line=1).prompts == ("x", "y", "z")
    own = tmp_path / "own.jsonl"
    own.write_text(json.dumps({"prompts": ["p", "q"], "switch_frame_indices": "9"}) + "\n")
    assert read_prompt_schedule(own).switch_frames == (9,)


def test_bad_schedules(tmp_path) -> None:
    path = tmp_path / "s.jsonl"
    path.write_text(json.dumps({"prompts": ["a", "b"]}) + "\n" + json.dumps({"prompts": ["c"]}) + "\n")
    with pytest.raises(ValueError, match="same number of prompts"):
        read_prompt_schedule(path, (3,))
    path.write_text("not json\n")
    with pytest.raises(ValueError, match=":1: not JSON"):
        read_prompt_schedule(path, ())
    with pytest.raises(ValueError, match="one index per prompt"):
        PromptSchedule(("a", "b"), ())
    with pytest.raises(ValueError, match="strictly increasing"):
        PromptSchedule(("a", "b", "c"), (9, 9))
    with pytest.raises(ValueError, match="item 'x'"):
        parse_switch_frames("3,x")


def test_generate_with_a_prompt_schedule(tmp_path) -> None:
    """LongLive with a switch at frame 10 (block 4): the first 4 blocks equal the one-prompt stream, the
    rest differ; the report records where the segments start."""
    sched = tmp_path / "p.jsonl"
    sched.write_text(json.dumps({"prompts": ["a red fox", "a blue whale"]}) + "\n")
    vids = []
    for extra in ([], ["--prompt-schedule", str(sched), "--switch-frames", "10"]):
        out, rep = tmp_path / f"v{len(extra)}.mp4", tmp_path / f"r{len(extra)}.json"
        args = [
            "generate",
            "--preset",
            "tiny",
            "--blocks",
            "7",
            "--method",
            "longlive",
            "--prompt",
            "a red fox",
            "--out",
            str(out),
        ]
        r = runner.invoke(app, [*args, "--report-json", str(rep), "--no-progress", "--no-warmup", *extra])
        assert r.exit_code == 0, r.output
        vids.append(read_video(out).astype(float))
    meta = json.loads(rep.read_text())["meta"]
    assert "segments start at blocks [0, 4]" in meta["text"]
    first = 9 + 3 * 12  # pixel frames of blocks 0..3
    same = float(abs(vids[0][:first] - vids[1][:first]).mean())
    diff = float(abs(vids[0][first:] - vids[1][first:]).mean())
    assert same < 0.5 < 2.0 < diff, (same, diff)  # H.264 noise of equal streams < 0.5 (test_cli.py)
    r = runner.invoke(
        app, ["generate", "--preset", "tiny", "--switch-frames", "3", "--out", str(tmp_path / "x.mp4")]
    )
    assert r.exit_code == 2 and "error: --switch-frames: needs --prompt-schedule" in r.output


@pytest.mark.parametrize("method", ["longlive", "rolling-forcing"])
def test_prompt_schedule_on_2_cores_equals_1_core(tmp_path, method: str) -> None:
    """The sharded stream takes the schedule up front at the windows where the one-core stream's
    set_prompt acts: the same video (H.264 noise of equal streams < 0.5 grey levels, test_cli.py)."""
    sched = tmp_path / "p.jsonl"
    sched.write_text(json.dumps({"prompts": ["a red fox", "a blue whale"]}) + "\n")
    vids = []
    for cores in ("1", "2"):
        out = tmp_path / f"c{cores}.mp4"
        args = [
            "generate",
            "--preset",
            "tiny",
            "--blocks",
            "6",
            "--method",
            method,
            "--out",
            str(out),
            "--cores",
            cores,
        ]
        extra = ["--prompt-schedule", str(sched), "--switch-frames", "9", "--two-pass"]
        r = runner.invoke(app, [*args, *extra, "--no-progress", "--no-warmup"])
        assert r.exit_code == 0, r.output
        vids.append(read_video(out).astype(float))
    assert float(abs(vids[0] - vids[1]).mean()) < 0.5


def test_generate_switch_modes(tmp_path) -> None:
    """``--switch``: the schedule's switch taken as a restart equals the continuing run before the switch
    and differs after it; the report names the mode; the defaults (demo restarts, LongLive re-caches, the
    others continue); every misuse is one line before any build."""
    sched = tmp_path / "p.jsonl"
    sched.write_text(json.dumps({"prompts": ["a red fox", "a blue whale"]}) + "\n")
    base = ["generate", "--preset", "tiny", "--blocks", "8", "--prompt", "a red fox", "--no-progress"]
    base += ["--no-warmup", "--prompt-schedule", str(sched), "--switch-frames", "9"]  # block 3
    vids, metas = {}, {}
    for mode in ("continue", "restart"):
        out, rep = tmp_path / f"{mode}.mp4", tmp_path / f"{mode}.json"
        r = runner.invoke(app, [*base, "--switch", mode, "--out", str(out), "--report-json", str(rep)])
        assert r.exit_code == 0, r.output
        vids[mode] = read_video(out).astype(float)
        metas[mode] = json.loads(rep.read_text())["meta"]
    assert [metas[m]["switch"] for m in ("continue", "restart")] == ["continue", "restart"]
    assert "segments start at blocks [0, 3], switches restart" in metas["restart"]["text"]
    assert "--switch restart" in metas["restart"]["command"]
    first = 9 + 2 * 12  # pixel frames of blocks 0..2
    same = float(abs(vids["continue"][:first] - vids["restart"][:first]).mean())
    diff = float(abs(vids["continue"][first:] - vids["restart"][first:]).mean())
    assert same < 0.5 < 2.0 < diff, (same, diff)  # H.264 noise of equal streams < 0.5 (test_cli.py)
    assert default_switch("demo", "ring") == "restart"
    assert default_switch("tiny", "window") == "recache" and default_switch("tiny", "ring") == "continue"
    x = ["--out", str(tmp_path / "x.mp4")]
    for extra, line in (
        (["--switch", "restart"], "error: --switch: needs --prompt-schedule"),
        (
            ["--prompt-schedule", str(sched), "--method", "self-forcing", "--switch", "recache"],
            "error: --switch: recache: --method self-forcing has no KV re-cache in its original",
        ),
        (
            ["--prompt-schedule", str(sched), "--cores", "2", "--switch", "restart"],
            "error: --switch: restart: the sharded stream (--cores > 1)",
        ),
    ):
        r = runner.invoke(app, ["generate", "--preset", "tiny", *extra, *x])
        assert r.exit_code == 2 and line in r.output, r.output
