"""Spawn ``world_size`` CPU ranks on gloo (localhost, free port), run a function, collect the results.

Used by the sharding tests and the sharded pipeline on CPU. On Trainium, ranks are started by
``torchrun`` / ``neuron_parallel_compile`` instead and the same rank functions run on the XLA group.
"""

from __future__ import annotations

import datetime
import io
import os
import queue as queue_mod
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

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


def _worker(
    rank: int,
    fn: Callable[..., Any],
    world_size: int,
    port: int,
    timeout_s: float,
    results: Any,
    args: tuple[Any, ...],
) -> None:
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
        results.put((rank, buf.getvalue()))
    finally:
        dist.destroy_process_group()


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
    :func:`sharding.attention.build_groups`), so a rank stuck in a collective raises after it. If any
    rank raises or exits, the others are terminated and :class:`LaunchError` names the failing rank and
    carries its traceback. If the whole launch takes longer than ``2 * timeout_s + 30`` seconds
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
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(list(preload))
    results = ctx.Queue()
    port = free_port()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    proc = mp.start_processes(
        _worker,
        args=(fn, world_size, port, timeout_s, results, args),
        nprocs=world_size,
        join=False,
        start_method=start_method,
    )
    got: dict[int, Any] = {}
    deadline = time.monotonic() + 2 * timeout_s + 30.0

    def drain() -> None:
        while True:
            try:
                rank, blob = results.get_nowait()
            except queue_mod.Empty:
                return
            got[rank] = torch.load(io.BytesIO(blob), weights_only=False)

    try:
        while True:
            drain()
            try:
                done = proc.join(timeout=0.2)
            except mp.ProcessRaisedException as exc:
                raise LaunchError(f"rank {exc.error_index} raised:\n{exc}", exc.error_index) from None
            except mp.ProcessExitedException as exc:
                raise LaunchError(
                    f"rank {exc.error_index} exited with code {exc.exit_code} ({exc})", exc.error_index
                ) from None
            if done:
                break
            if time.monotonic() > deadline:
                alive = [i for i, p in enumerate(proc.processes) if p.is_alive()]
                raise LaunchError(
                    f"launch timed out after {2 * timeout_s + 30:.0f} s; ranks still running: {alive}", None
                )
        wait_until = time.monotonic() + 10.0
        while len(got) < world_size and time.monotonic() < wait_until:
            drain()
            time.sleep(0.01)
    finally:
        for p in proc.processes:
            if p.is_alive():
                p.terminate()
        for p in proc.processes:
            p.join(timeout=5)
        results.close()
    missing = sorted(set(range(world_size)) - set(got))
    if missing:
        raise LaunchError(f"ranks {missing} finished without returning a result", missing[0])
    return [got[r] for r in range(world_size)]
