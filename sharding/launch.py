"""Spawn ``world_size`` CPU ranks on gloo (localhost, free port), run a function, collect the results.

Used by the sharding tests and the sharded pipeline on CPU. On Trainium, ranks are started by
``torchrun`` / ``neuron_parallel_compile`` instead and the same rank functions run on the XLA group.
"""

from __future__ import annotations

import datetime
import io
import multiprocessing as mp
import queue as queue_mod
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["DEFAULT_PRELOAD", "LaunchError", "free_port", "launch"]

DEFAULT_PRELOAD: tuple[str, ...] = (
    "torch",
    "torch.distributed",
    "torch._dynamo",  # imported by the first torch.library custom-op call (~1.7 s per rank otherwise)
    "nki_kernels.ops",
    "sharding.attention",
    "sharding.launch",
)


class LaunchError(RuntimeError):
    """A rank failed (raised, exited, or the launch timed out); ``rank`` names it (None on timeout)."""

    def __init__(self, message: str, rank: int | None) -> None:
        super().__init__(message)
        self.rank = rank


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# errors that are consequences of another rank failing, not a root cause
_SYMPTOMS = ("Connection closed by peer", "Connection reset by peer", "Timed out", "timed out")


def _worker(
    rank: int,
    fn: Callable[..., Any],
    world_size: int,
    port: int,
    timeout_s: float,
    results: Any,
    args: tuple[Any, ...],
) -> None:
    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        try:
            value = fn(rank, world_size, *args)
            buf = io.BytesIO()
            torch.save(value, buf)
            results.put(("ok", rank, time.time(), buf.getvalue()))
        finally:
            dist.destroy_process_group()
    except BaseException:
        results.put(("error", rank, time.time(), traceback.format_exc()))
        raise SystemExit(1) from None


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 60.0,
    start_method: str = "forkserver",
    preload: Sequence[str] = DEFAULT_PRELOAD,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results by rank.

    ``fn`` must be picklable (a module-level function); its return value must be ``torch.save``-able.
    The default process group is created with ``timeout_s`` (pass the same value to
    :func:`sharding.attention.build_groups`), so a rank stuck in a collective raises after it.

    If any rank raises or exits non-zero, the launcher waits ``grace`` = 1 s for the others to fail on
    their own, terminates the rest, and raises :class:`LaunchError` whose ``rank`` is the root cause:
    the earliest failure that is not a mere symptom of another rank's death ("connection closed by
    peer", "timed out"), else the earliest failure. The message lists every failed rank with its
    traceback or exit code. If the whole launch takes longer than ``2 * timeout_s + 30`` seconds
    (startup of ``world_size`` interpreters on a small machine included), all ranks are terminated and
    :class:`LaunchError` lists the ranks still running.

    ``start_method`` ``"forkserver"`` (default) forks every rank from one server process that imported
    ``preload`` once (a fresh interpreter, so no OpenMP state is inherited): 8 ranks start in about a
    second instead of importing torch 8 times. ``preload`` only takes effect when the process's
    forkserver is first started; modules that fail to import are skipped by multiprocessing.
    ``"spawn"`` is also accepted.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if start_method not in ("forkserver", "spawn"):
        raise ValueError(f"start_method must be 'forkserver' or 'spawn', got {start_method!r}")
    ctx: Any = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(list(preload))
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(rank, fn, world_size, port, timeout_s, results, args),
            name=f"sharding-rank-{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    got: dict[int, Any] = {}
    errors: dict[int, tuple[float, str]] = {}
    exits: dict[int, tuple[float, int]] = {}
    limit = 2 * timeout_s + 30.0
    deadline = time.monotonic() + limit

    def drain() -> None:
        while True:
            try:
                kind, rank, stamp, payload = results.get_nowait()
            except queue_mod.Empty:
                return
            if kind == "ok":
                got[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors[rank] = (stamp, payload)

    def poll() -> None:
        for rank, p in enumerate(procs):
            if rank not in exits and p.exitcode is not None:
                exits[rank] = (time.time(), p.exitcode)

    try:
        for p in procs:
            p.start()
        failed_at: float | None = None
        while True:
            drain()
            poll()
            if failed_at is None and (errors or any(code != 0 for _, code in exits.values())):
                failed_at = time.monotonic()
            if failed_at is not None and (time.monotonic() - failed_at > 1.0 or len(exits) == world_size):
                drain()
                poll()
                err = _failure(errors, exits)
                alive = [r for r, p in enumerate(procs) if p.is_alive()]
                if alive:
                    err = LaunchError(f"{err}\n--- ranks still running (terminated): {alive}", err.rank)
                raise err
            if len(exits) == world_size:
                break
            if time.monotonic() > deadline:
                alive = [r for r, p in enumerate(procs) if p.is_alive()]
                raise LaunchError(f"launch timed out after {limit:.0f} s; ranks still running: {alive}", None)
            time.sleep(0.05)
        wait_until = time.monotonic() + 10.0
        while len(got) < world_size and time.monotonic() < wait_until:
            drain()
            time.sleep(0.01)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=5)
        results.close()
    missing = sorted(set(range(world_size)) - set(got))
    if missing:
        raise LaunchError(f"ranks {missing} finished without returning a result", missing[0])
    return [got[r] for r in range(world_size)]


def _failure(errors: dict[int, tuple[float, str]], exits: dict[int, tuple[float, int]]) -> LaunchError:
    """Build the error for a failed launch: root-cause rank first, then every other failure."""
    events: list[tuple[bool, float, int, str]] = []
    for rank, (stamp, tb) in errors.items():
        symptom = any(s in tb.strip().splitlines()[-1] for s in _SYMPTOMS)
        last = tb.strip().splitlines()[-1]
        events.append((symptom, stamp, rank, f"rank {rank} raised: {last}\n{tb}"))
    for rank, (stamp, code) in exits.items():
        if rank not in errors and code != 0:
            how = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
            events.append((False, stamp, rank, f"rank {rank} {how} without a Python exception"))
    events.sort()
    root = events[0]
    others = "\n".join(e[3] for e in events[1:])
    msg = root[3] + (f"\n--- other failed ranks ---\n{others}" if others else "")
    return LaunchError(msg, root[2])
