"""The ``rolling-forcing`` command as a user meets it: run as a subprocess on the tiny preset, every
predictable mistake ends in ONE ``error: <argument>: <rule>`` line with exit code 2 (usage) or 1 (runtime),
no traceback and no file at ``--out``; SIGINT / SIGTERM keep ``<stem>.partial.mp4`` and a report that says
``"interrupted": true`` (exit 130 / 143); SIGKILL of the main process leaves no rank process alive.

Every mistake runs in-process through the console entry point ``nki_ardiff.cli.main`` (argument
parsing, checks, exit code and stderr exactly as installed; ~0.1-1 s each), and a subset also as a real
subprocess (interpreter start ~3 s each, two at a time); the stopped streams are subprocesses.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from rolling_forcing.checkpoint import save_safetensors
from rolling_forcing.config import get_preset
from rolling_forcing.model import CausalWanModel
from rolling_forcing.text import SeededTextEncoder
from rolling_forcing.video import read_video

ROOT = Path(__file__).resolve().parents[1]


GEN = ["generate", "--preset", "tiny"]  # these cases run the tiny preset (random weights)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("NKI_ARDIFF_BACKEND", "NKI_ARDIFF_DEBUG")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return {**env, **extra}


def _cmd(args: list[str], pre: str = "") -> list[str]:
    """``python -m nki_ardiff ARGS``; with ``pre``, that code runs first (e.g. to hide a package)."""
    if not pre:
        return [sys.executable, "-m", "nki_ardiff", *args]
    code = f"{pre}\nimport sys\nfrom nki_ardiff.entry import main\nmain(sys.argv[1:])"
    return [sys.executable, "-c", code, *args]


def _run(args: list[str], pre: str = "", **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(_cmd(args, pre), capture_output=True, text=True, timeout=120, env=_env(**env))


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Bad inputs on the tiny preset's shapes: corrupt / truncated / NaN / int32 checkpoints, NaN embeds."""
    d = tmp_path_factory.mktemp("inputs")
    cfg = get_preset("tiny")
    state = CausalWanModel(cfg).init_random(5).state_dict()
    good = d / "good.safetensors"
    save_safetensors(state, good)
    raw = good.read_bytes()
    (d / "truncated.safetensors").write_bytes(raw[: len(raw) // 2])
    (d / "corrupt.safetensors").write_bytes(b"\x07not a safetensors file" * 8)
    nan = dict(state)
    nan["blocks.0.self_attn.q.weight"] = nan["blocks.0.self_attn.q.weight"].clone()
    nan["blocks.0.self_attn.q.weight"][0, 0] = float("nan")
    save_safetensors(nan, d / "nan.safetensors")
    ints = dict(state, **{"head.head.weight": state["head.head.weight"].to(torch.int32)})
    save_safetensors(ints, d / "int.safetensors")
    # finite weights whose activations overflow fp32: the stream itself turns non-finite (a runtime failure)
    save_safetensors({k: v * 1e30 if v.ndim == 2 else v for k, v in state.items()}, d / "huge.safetensors")
    emb = SeededTextEncoder(cfg.text_len, cfg.text_dim).encode(["x"])
    emb[0, 3, 5] = float("inf")
    save_safetensors({"prompt_embeds": emb}, d / "nan_embeds.safetensors")
    (d / "existing.mp4").write_bytes(b"an earlier video")
    (d / "a_file").write_text("not a directory")
    return {p.stem if p.suffix else p.name: p for p in d.iterdir()} | {"dir": d}


# case -> (args, code run first, exit code, argument named, words of the rule)
def _cases(f: dict[str, Path]) -> dict[str, tuple[list[str], str, int, str, str]]:
    out = str(f["dir"] / "never.mp4")
    gen = [*GEN, "--blocks", "5", "--no-warmup", "-q"]
    hide_hf = "import sys; sys.modules['diffusers'] = None; sys.modules['transformers'] = None"
    return {
        "corrupt": ([*gen, "--checkpoint", str(f["corrupt"]), "--out", out], "", 2, "--checkpoint",
                    "truncated or corrupt"),
        "truncated": ([*gen, "--checkpoint", str(f["truncated"]), "--out", out], "", 2, "--checkpoint",
                      "truncated or corrupt"),
        "nan_weights": (
            [*gen, "--checkpoint", str(f["nan"]), "--out", out], "", 2, "--checkpoint",
            "'blocks.0.self_attn.q.weight' has 1 non-finite",
        ),
        "int_weights": (
            [*gen, "--checkpoint", str(f["int"]), "--out", out], "", 2, "--checkpoint",
            "'head.head.weight' has dtype torch.int32",
        ),
        "nan_embeds": ([*gen, "--prompt-embeds", str(f["nan_embeds"]), "--out", out], "", 2,
                       "--prompt-embeds", "1 non-finite"),
        "nan_latents": ([*gen, "--checkpoint", str(f["huge"]), "--out", out], "", 1, "generate",
                        "block 0 produced non-finite latents"),
        "report_is_out": (
            [*gen, "--out", str(f["existing"]), "--report-json", str(f["existing"])], "", 2, "--report-json",
            "must end with .json",
        ),
        "read_only": ([*gen, "--out", "/proc/rf-demo.mp4"], "", 2, "--out",
                      "cannot create a file in '/proc'"),
        "parent_is_file": ([*gen, "--out", str(f["a_file"] / "x.mp4")], "", 2, "--out", "is not a directory"),
        "directory": ([*gen, "--out", str(f["dir"])], "", 2, "--out", "is a directory"),
        "extension": ([*gen, "--out", str(f["dir"] / "x.avi")], "", 2, "--out", "must end with .mp4"),
        "seconds_inf": ([*GEN, "--seconds", "inf", "--out", out], "", 2, "--seconds", "finite"),
        "seconds_nan": ([*GEN, "--seconds", "nan", "--out", out], "", 2, "--seconds", "finite"),
        "seconds_huge": ([*GEN, "--seconds", "1e9", "--out", out], "", 2, "--seconds", "at most 86400"),
        "seconds_table": (
            [*GEN, "--seconds", "600", "--out", out], "", 2, "--seconds",
            "1024-position RoPE table; switch with --positions relative",
        ),
        "blocks_zero": ([*GEN, "--blocks", "0", "--out", out], "", 2, "--blocks", "must be in [1,"),
        "seed": ([*GEN, "--seed", "-1", "--out", out], "", 2, "--seed", "[0, 2**63 - 2]"),
        "preset": ([*GEN, "--preset", "huge", "--out", out], "", 2, "--preset", "'huge' is not one of"),
        "no_checkpoint": ([*GEN, "--preset", "wan2.1-1.3b", "--out", out], "", 2, "--checkpoint",
                          "needs weights"),
        "backend": ([*GEN, "--backend", "neuron", "--out", out], "", 2, "--backend", "Neuron SDK"),
        "backend_env": ([*GEN, "--out", out], "", 2, "--backend", "is not one of"),
        "vae_extra": (
            [*gen, "--vae", str(f["dir"]), "--out", out], hide_hf, 2, "--vae", "pip install -e '.[hf]'"
        ),
        "text_extra": (
            [*gen, "--text-encoder", str(f["dir"]), "--out", out], hide_hf, 2, "--text-encoder", "hf extra"
        ),
    }  # fmt: skip


ENVS = {"backend_env": {"NKI_ARDIFF_BACKEND": "tpu"}}
SUBPROCESS_CASES = ("preset", "corrupt", "nan_latents")


@pytest.fixture(scope="module")
def results(files: dict[str, Path]) -> dict[str, subprocess.CompletedProcess[str]]:
    cases = _cases(files)
    with ThreadPoolExecutor(max_workers=2) as pool:
        futs = {k: pool.submit(_run, cases[k][0], cases[k][1], **ENVS.get(k, {})) for k in SUBPROCESS_CASES}
        return {k: f.result() for k, f in futs.items()}


def _in_process(
    args: list[str], pre: str, env: dict[str, str], capfd: pytest.CaptureFixture[str], mp
) -> tuple:
    """Run the console entry point in this process; return (exit code, stdout, stderr)."""
    from nki_ardiff.cli import main

    for k in ("NKI_ARDIFF_BACKEND", "NKI_ARDIFF_DEBUG"):
        mp.delenv(k, raising=False)
    for k, v in env.items():
        mp.setenv(k, v)
    if pre:  # the only prelude: hide the hf extra's packages
        mp.setitem(sys.modules, "diffusers", None)
        mp.setitem(sys.modules, "transformers", None)
    capfd.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(args)
    out, err = capfd.readouterr()
    return exc.value.code, out, err


def _check_one_line(case: str, code: int, out: str, err: str, files: dict[str, Path]) -> None:
    _, _, want_code, argument, words = _cases(files)[case]
    assert code == want_code, (case, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, (case, err)
    assert lines[0].startswith(f"error: {argument}: "), (case, lines[0])
    assert words in lines[0], (case, lines[0])
    assert "Traceback" not in err + out
    assert files["existing"].read_bytes() == b"an earlier video"  # never replaced, never half-written
    left = [p.name for p in files["dir"].iterdir() if p.name.startswith((".never", "never"))]
    assert left == [], left


CASES = (
    "corrupt", "truncated", "nan_weights", "int_weights", "nan_embeds", "nan_latents", "report_is_out",
    "read_only", "parent_is_file", "directory", "extension", "seconds_inf", "seconds_nan", "seconds_huge",
    "seconds_table", "blocks_zero", "seed", "preset", "no_checkpoint", "backend", "backend_env", "vae_extra",
    "text_extra",
)  # fmt: skip


def test_every_case_is_listed(files: dict[str, Path]) -> None:
    assert set(CASES) == set(_cases(files))


@pytest.mark.parametrize("case", CASES)
def test_mistake_is_one_error_line(case: str, files: dict[str, Path], capfd, monkeypatch) -> None:
    args, pre, *_ = _cases(files)[case]
    code, out, err = _in_process(args, pre, ENVS.get(case, {}), capfd, monkeypatch)
    _check_one_line(case, code, out, err, files)


@pytest.mark.parametrize("case", SUBPROCESS_CASES)
def test_mistake_is_one_error_line_subprocess(case: str, files: dict[str, Path], results: dict) -> None:
    r = results[case]
    _check_one_line(case, r.returncode, r.stdout, r.stderr, files)


def test_debug_shows_the_traceback(files: dict[str, Path], monkeypatch) -> None:
    """--debug (or NKI_ARDIFF_DEBUG=1) lets the error propagate with its traceback instead of one line."""
    from nki_ardiff.cli import main
    from nki_ardiff.cli_checks import CliError

    args = [
        "generate",
        "--preset",
        "tiny",
        "--blocks",
        "5",
        "--checkpoint",
        str(files["nan"]),
        "--out",
        "never.mp4",
    ]
    with pytest.raises(CliError, match="non-finite"):
        main(["--debug", *args])
    monkeypatch.setenv("NKI_ARDIFF_DEBUG", "1")
    with pytest.raises(CliError, match="blocks.0.self_attn.q.weight"):
        main(args)


def _descendants(pid: int) -> set[int]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            kids.setdefault(ppid, []).append(int(d))
    out, todo = set(), [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc to find the rank processes")
@pytest.mark.parametrize(
    ("cores", "sig"),
    [
        (1, signal.SIGINT),
        (1, signal.SIGTERM),
        pytest.param(1, signal.SIGKILL, marks=pytest.mark.slow),
        (2, signal.SIGTERM),
        (2, signal.SIGKILL),
        pytest.param(2, signal.SIGINT, marks=pytest.mark.slow),
    ],
)
def test_stopped_stream(tmp_path: Path, cores: int, sig: signal.Signals) -> None:
    """Stop a long stream once its first chunk is written: SIGINT/SIGTERM keep demo.partial.mp4 (playable)
    and an interrupted report and exit 128 + signal; SIGKILL leaves only the hidden temporary file. No
    process started by the run survives 5 s in any case."""
    out, rep = tmp_path / "demo.mp4", tmp_path / "demo.json"
    args = [*GEN, "--blocks", "300", "--no-warmup", "-q", "--cores", str(cores)]
    proc = subprocess.Popen(
        _cmd([*args, "--out", str(out), "--report-json", str(rep)]),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
    )  # fmt: skip
    family: set[int] = set()
    try:
        deadline = time.monotonic() + 90
        while not list(tmp_path.glob(".demo.*.tmp.mp4")) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.1)
        time.sleep(0.5)
        family = _descendants(proc.pid)
        assert len(family) >= (3 if cores == 2 else 0), family  # forkserver + 2 ranks (+ resource tracker)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
        t_end = time.monotonic() + 5
        while any(_running(p) for p in family) and time.monotonic() < t_end:
            time.sleep(0.1)
        alive = [p for p in family if _running(p)]
        assert alive == [], f"processes of the run still alive 5 s after {sig.name}: {alive}"
    finally:  # never leak the run's processes into the rest of the suite (they are killed, the test fails)
        for p in [proc.pid, *family]:
            if _running(p):
                os.kill(p, signal.SIGKILL)
        proc.wait(timeout=10)
    assert not out.exists()
    if sig == signal.SIGKILL:
        assert proc.returncode == -signal.SIGKILL and not rep.exists()
        assert [p.name for p in tmp_path.iterdir()] == [f".demo.{proc.pid}.tmp.mp4"]
        return
    assert proc.returncode == 128 + sig, err
    assert err.strip().splitlines()[-1].startswith(f"interrupted by {sig.name}: the ")
    data = json.loads(rep.read_text())
    partial = tmp_path / "demo.partial.mp4"
    assert data["interrupted"] is True and data["signal"] == sig.name and data["error"] is None
    assert data["partial_video"] == str(partial)
    n = data["summary"]["chunks"]
    assert 1 <= n < 300 and data["summary"]["video_frames"] == 12 * n - 3
    assert read_video(partial).shape == (12 * n - 3, 64, 64, 3)  # every chunk the report lists, playable
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo.json", "demo.partial.mp4"]
