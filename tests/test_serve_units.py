"""rolling_forcing.serve's pure parts: playout buffer and clock, start threshold, admission rule, the
reaper (on a fake clock), Prometheus rendering (parsed by prometheus_client, an independent parser),
config and prompt rules."""

from __future__ import annotations

import math
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rolling_forcing.serve.config import ServeConfig
from rolling_forcing.serve.manager import admission_refusal
from rolling_forcing.serve.metrics import Histogram, render
from rolling_forcing.serve.playout import Frame, PlayoutBuffer, first_frame_of_block, start_threshold
from rolling_forcing.serve.session import RuleError, check_prompt, json_safe
from rolling_forcing.video import VideoSpec


def _frames(start: int, n: int, block: int = 0) -> list[Frame]:
    return [Frame(start + i, block, bytes([i])) for i in range(n)]


def test_start_threshold_rides_out_the_p99_wait() -> None:
    assert start_threshold(0.080, 16.0, 24) == 2  # 1.28 frames play during an 80 ms wait -> 2
    assert start_threshold(0.0625, 16.0, 24) == 1  # exactly one frame period
    assert start_threshold(0.0, 16.0, 24) == 1  # at least one frame
    assert start_threshold(10.0, 16.0, 24) == 24  # never more than the buffer holds
    with pytest.raises(ValueError, match="p99_wait_s"):
        start_threshold(math.nan, 16.0, 24)
    with pytest.raises(ValueError, match="depth"):
        start_threshold(0.1, 16.0, 0)


def test_first_frame_of_block_is_the_frame_count_of_the_blocks_before() -> None:
    spec = VideoSpec()  # independent count: Wan's causal decoder, 1 + 4 (F - 1) frames for F latent frames
    for b in range(6):
        assert first_frame_of_block(b) == spec.video_frames(b, 3)
    with pytest.raises(ValueError, match="block"):
        first_frame_of_block(-1)


def test_playout_clock_starts_at_threshold_and_counts_late_frames() -> None:
    fps = 10.0
    buf = PlayoutBuffer(depth=24, fps=fps, start_frames=3)
    buf.push(_frames(0, 2), now=0.0)
    assert buf.poll(1.0) == [] and not buf.started  # 2 < 3 frames held: no start
    buf.push(_frames(2, 10, block=1), now=1.0)
    t0 = 2.0
    assert [f.index for f in buf.poll(t0)] == [0]  # the clock starts: frame 0 is due at once
    assert [f.index for f in buf.poll(t0 + 0.15)] == [1]  # slot t0 + 0.1, 0.05 s late: shown
    assert [f.index for f in buf.poll(t0 + 0.21)] == [2]
    # at t0 + 0.95: frames 3..9 are due; those more than one period (0.1 s) late missed their slot
    shown = buf.poll(t0 + 0.95)
    assert [f.index for f in shown] == [9]  # 0.05 s late: still shown
    assert buf.dropped == 6 and buf.sent == 4  # 3..8 dropped, counted; 0, 1, 2, 9 sent
    assert len(buf) == 2 and buf.next_due() == pytest.approx(t0 + 1.0)
    assert buf.lead_s(t0 + 0.95) == pytest.approx(0.25)  # frames up to index 11 cover until t0 + 1.2
    # a chunk pushed after its first frame's slot is a late chunk (a deadline miss)
    buf.push(_frames(12, 4), now=t0 + 1.25)
    assert buf.late_chunks == 1
    buf.push(_frames(16, 4), now=t0 + 1.25)  # slot of 16 is t0 + 1.6: in time
    assert buf.late_chunks == 1


def test_playout_buffer_refuses_overflow_and_gaps() -> None:
    buf = PlayoutBuffer(depth=12, fps=16.0, start_frames=1)
    buf.push(_frames(0, 9), now=0.0)
    assert buf.room() == 3
    with pytest.raises(ValueError, match="does not fit"):
        buf.push(_frames(9, 12), now=0.0)
    with pytest.raises(ValueError, match="out of order"):
        buf.push(_frames(10, 1), now=0.0)
    with pytest.raises(ValueError, match="start_frames"):
        PlayoutBuffer(depth=12, fps=16.0, start_frames=13)


def test_admission_rule_sums_session_costs_against_the_deadline_budget() -> None:
    # budget 0.75 * (1 - 0.2) = 0.6 s
    assert admission_refusal([0.2, 0.2], 0.2, 0.75, 0.2, 8) is None  # 0.6 fits exactly
    reason = admission_refusal([0.2, 0.2], 0.21, 0.75, 0.2, 8)
    assert reason is not None and "610.0 ms > budget 600.0 ms" in reason and "3 session(s)" in reason
    assert admission_refusal([], 0.7, 0.75, 0.0, 1) is None
    assert "max_sessions=2" in (admission_refusal([0.01, 0.01], 0.01, 0.75, 0.2, 2) or "")


class _Clock:
    """A settable ``time.monotonic`` (the reaper's clock); ``perf_counter`` stays real."""

    perf_counter = staticmethod(time.perf_counter)

    def __init__(self, t: float) -> None:
        self.t = t

    def monotonic(self) -> float:
        return self.t


def test_reaper_closes_sessions_without_a_viewer_and_never_a_watched_one(monkeypatch) -> None:
    """connect_timeout_s counts while no viewer is connected (since admission, or since the viewer left);
    a session whose viewer is connected stays open however long it runs. Edge: exactly the timeout is
    not over it. A fake clock stands in for time.monotonic in the manager and the session modules."""
    from rolling_forcing.serve import manager as manager_mod
    from rolling_forcing.serve import session as session_mod
    from rolling_forcing.serve.engine import Engine
    from rolling_forcing.serve.manager import SessionManager

    clock = _Clock(1000.0)
    monkeypatch.setattr(manager_mod, "time", clock)
    monkeypatch.setattr(session_mod, "time", clock)
    timeout = 10.0
    engine = Engine(ServeConfig(preset="tiny", session_interval_s=0.0, connect_timeout_s=timeout))
    engine.costs.add(0.01)  # stands in for calibrate(): admission needs a measured cost
    mgr = SessionManager(engine)
    watched, absent = mgr.admit("a cat", 1), mgr.admit("a dog", 2)
    watched.connected = True  # what the viewer's WebSocket handler sets (serve/app.py)
    clock.t = 1000.0 + timeout  # exactly the timeout since admission: not yet over it
    mgr._reap()
    assert set(mgr.sessions) == {watched.id, absent.id}
    clock.t = 1000.0 + timeout + 0.5
    mgr._reap()
    assert set(mgr.sessions) == {watched.id}
    assert absent.closed and absent.stream is None and not watched.closed
    assert mgr.reports[absent.id]["serve"]["close_reason"] == "viewer absent: no connection for 10 s"
    clock.t = 1000.0 + 100 * timeout  # watched for 100 timeouts: still open
    mgr._reap()
    assert set(mgr.sessions) == {watched.id} and watched.stream is not None
    watched.connected, watched.last_seen = False, clock.t  # the viewer leaves (as serve/app.py records it)
    clock.t += timeout
    mgr._reap()
    assert set(mgr.sessions) == {watched.id}
    clock.t += 0.5
    mgr._reap()
    assert mgr.sessions == {} and watched.closed
    assert dict(mgr.closed_by) == {"viewer absent": 2}
    mgr.stop()


def test_metrics_text_parses_with_prometheus_client() -> None:
    h = Histogram((0.1, 0.5, 1.0))
    for v in (0.05, 0.2, 0.2, 0.7, 3.0):
        h.observe(v)
    text = render(
        histograms={"x_seconds": ("a histogram", h)},
        counters={"x_events_total": ("events", [({"reason": 'a "b"\nc'}, 2.0)])},
        gauges={"x_depth": ("depth", [({"session": "s1"}, 7), ({"session": "s2"}, 0)])},
    )
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    assert fams["x_seconds"].type == "histogram"
    buckets = {s.labels["le"]: s.value for s in fams["x_seconds"].samples if s.name == "x_seconds_bucket"}
    assert buckets == {"0.1": 1, "0.5": 3, "1.0": 4, "+Inf": 5}  # cumulative counts
    total = {s.name: s.value for s in fams["x_seconds"].samples}
    assert total["x_seconds_count"] == 5 and total["x_seconds_sum"] == pytest.approx(4.15)
    ev = fams["x_events"]
    assert (
        ev.type == "counter" and ev.samples[0].labels == {"reason": 'a "b"\nc'} and ev.samples[0].value == 2
    )
    assert {s.labels["session"]: s.value for s in fams["x_depth"].samples} == {"s1": 7, "s2": 0}
    with pytest.raises(ValueError, match="_total"):
        render(histograms={}, counters={"x": ("bad", [])}, gauges={})
    with pytest.raises(ValueError, match="increasing"):
        Histogram((1.0, 0.5))


def test_config_rules_name_the_field() -> None:
    assert ServeConfig().host == "127.0.0.1"  # loopback by default
    assert ServeConfig().preset == "demo"  # the shipped trained model by default
    assert ServeConfig().deadline_s == pytest.approx(0.75)
    for kwargs, field in [
        ({"buffer_frames": 11}, "buffer_frames"),
        ({"headroom": 1.0}, "headroom"),
        ({"max_sessions": 0}, "max_sessions"),
        ({"image_format": "gif"}, "image_format"),
        ({"preset": "wan9"}, "preset"),
        ({"fps": 0.0}, "fps"),
        ({"port": 70000}, "port"),
        ({"prompt_interval_s": -1.0}, "prompt_interval_s"),
    ]:
        with pytest.raises(ValueError, match=field):
            ServeConfig(**kwargs)


def test_prompt_rule_and_json_safety() -> None:
    assert check_prompt("  a fox  ", 10) == "a fox"
    with pytest.raises(RuleError, match="at most 10 characters, got 11") as e:
        check_prompt("x" * 11, 10)
    assert e.value.status == 422
    with pytest.raises(RuleError, match="must not be empty"):
        check_prompt("   ", 10)
    with pytest.raises(RuleError, match="must be a string"):
        check_prompt(3, 10)
    assert json_safe({"a": [1.0, math.nan, {"b": math.inf}], "c": "x"}) == {
        "a": [1.0, None, {"b": None}],
        "c": "x",
    }


def test_guard_rules() -> None:
    from rolling_forcing.serve.guard import host_name, is_loopback, refusal

    assert (
        is_loopback("127.0.0.1")
        and is_loopback("127.8.0.1")
        and is_loopback("::1")
        and is_loopback("localhost")
    )
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.2") and not is_loopback("example.org")
    assert (
        host_name("[::1]:8000") == "::1"
        and host_name("LocalHost:80") == "localhost"
        and host_name("a") == "a"
    )
    loop = ("127.0.0.1", "localhost", "::1")
    assert refusal("127.0.0.1:8000", None, loop) is None
    assert refusal("127.0.0.1:8000", "http://127.0.0.1:8000", loop) is None
    assert "Host header" in (refusal("evil.example:8000", None, loop) or "")
    assert "Origin" in (refusal("127.0.0.1:8000", "http://127.0.0.1:9999", loop) or "")  # another local port
    assert refusal("example.org", None, ()) is None  # a non-loopback bind: any Host
    assert ServeConfig().host_names == loop and ServeConfig(host="0.0.0.0").host_names == ()


def test_serve_extra_holds_what_the_command_checks_and_the_test_extra_the_server() -> None:
    from pathlib import Path

    import tomllib

    from rolling_forcing.serve.command import SERVE_MODULES

    extras = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())[
        "project"
    ]["optional-dependencies"]

    def names(reqs: list[str]) -> set[str]:
        return {r.split(">")[0].split("=")[0].split("[")[0].strip() for r in reqs}

    assert names(extras["serve"]) >= set(SERVE_MODULES.values()) | {"nki-ardiff"}  # nki-ardiff[cli]
    assert names(extras["test"]) >= set(SERVE_MODULES.values()) | {"httpx", "prometheus-client"}


def _no_build(monkeypatch) -> None:
    """Make building a model fail loudly: every refusal below must come before any build."""
    from nki_ardiff import cli_serve

    def boom(opts: object) -> None:
        raise AssertionError("a model was built before the options were checked")

    monkeypatch.setattr(cli_serve, "build_parts", boom)


def test_serve_subcommand_is_registered_and_refuses_bad_options_before_starting(monkeypatch) -> None:
    from typer.testing import CliRunner

    from nki_ardiff.cli import app

    _no_build(monkeypatch)
    runner = CliRunner()
    help_ = runner.invoke(app, ["serve", "--help"])
    assert help_.exit_code == 0 and "--max-sessions" in help_.output and "127.0.0.1" in help_.output
    assert "--checkpoint" in help_.output and "--text-encoder" in help_.output and "--vae" in help_.output
    bad = runner.invoke(app, ["serve", "--buffer-frames", "5"])
    assert bad.exit_code == 2
    assert (
        bad.output
        == "error: --buffer-frames: buffer_frames must hold at least one chunk (12 frames), got 5\n"
    )
    bad = runner.invoke(app, ["serve", "--threads", "0"])
    assert bad.exit_code == 2 and bad.output == "error: --threads: threads must be >= 1, got 0\n"


@pytest.mark.parametrize(
    "args",
    [
        ["--preset", "wan2.1-1.3b"],  # weights needed
        ["--preset", "tiny", "--checkpoint", "nope.safetensors"],  # a missing input
        ["--vae", "."],  # the demo preset (the default) has its own decoder
        ["--text-encoder", "."],
        ["--preset", "tiny", "--lora", "pyproject.toml"],  # a LoRA without base weights
        ["--preset", "tiny", "--vae", "pyproject.toml"],  # a file where a directory is needed
        ["--preset", "nope"],  # not a preset (click's choice error)
        ["--checkpoint", "pyproject.toml"],  # demo: a file, not the directory train-demo wrote
        ["--checkpoint", "docs"],  # demo: a directory without the three files
        ["--use-ema"],  # demo: its weights are EMA weights already
    ],
)
def test_serve_refuses_model_options_with_generates_line(
    args: list[str], monkeypatch, capsys, tmp_path
) -> None:
    """The model options are generate's, checked by the same code: the same one error line, exit 2."""
    from nki_ardiff.cli import main

    _no_build(monkeypatch)
    lines = {}
    for cmd in (["serve"], ["generate", "--out", str(tmp_path / "a.mp4")]):
        with pytest.raises(SystemExit) as e:
            main([*cmd, *args])
        assert e.value.code == 2
        out = capsys.readouterr()
        assert out.out == "" and out.err.count("\n") == 1, out
        lines[cmd[0]] = out.err.strip()
    assert lines["serve"].startswith("error: --")
    assert lines["serve"] == lines["generate"].replace("rolling-forcing generate", "rolling-forcing serve")


def test_serve_text_encoder_rule_names_only_serves_options(monkeypatch) -> None:
    """A preset without seeded embeddings needs a text encoder; serve has no --prompt-embeds (typed
    prompts), so its rule names --text-encoder only."""
    from typer.testing import CliRunner

    from nki_ardiff.cli import app

    _no_build(monkeypatch)
    r = CliRunner().invoke(app, ["serve", "--preset", "mid", "--checkpoint", "pyproject.toml"])
    assert r.exit_code == 2 and r.output == (
        "error: --text-encoder: preset 'mid' needs real text conditioning: pass --text-encoder DIR (umT5) "
        "(seeded embeddings are only for the tiny preset)\n"
    )
