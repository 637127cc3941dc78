"""How many NEFFs a chunk launches, derived from how the pipeline compiles (pure functions).

On Neuron every compiled graph is a NEFF; each NEFF launch pays the host submit + barriers measured by
the open Rolling Forcing port (:class:`~perf.e2e.params.E2EParams` ``neff_launch_s``), and each kernel
call inside a NEFF pays the per-kernel fixed cost (``kernel_fixed_s``, charged by the chunk model).
Three compile modes:

* ``"fullgraph"``: one NEFF per forward.  This holds for the single-process merged forward:
  ``rolling_forcing.merged.MergedForward`` compiles it with ``torch.compile(fullgraph=True)`` and the
  stream has one graph, no graph break and no recompile (``docs/merged_forward.md``, measured on CPU).
  The sharded stream with ``compile=`` (``generate --cores N --compile``) holds it too: its collectives
  are functional ops inside the one graph (``sharding/collectives.py``; ``tests/test_sharding_compile.py``
  checks one graph per stream and ties its collectives and kernel calls to this model).
  Per forward one more small graph runs the sampler update between forwards (flow -> x0 -> re-noise,
  eager tensor ops); per chunk one NEFF decodes the finished block with the VAE (the decoder compiled
  whole, as the Rolling Forcing port does).
* ``"eager_sharded"``: ``sharding.pipeline`` without ``compile=``: eager forwards whose collectives are issued
  from the host (``torch.distributed`` calls, not traced).  Each host collective cuts the graph, so a
  forward with ``C`` collectives is ``C + 1`` graphs plus ``C`` collective launches (a collective
  outside a graph is a program of its own); plus the sampler graph per forward and the VAE NEFF per
  chunk.  ``C`` = layers x collectives per layer (the plan's all-to-all / all-gather set) + the head
  all-gather of a forward that has a head.
* ``"peer"``: a launch count fed from outside (the Rolling Forcing port's ~370 NEFFs per rank per
  forward, sub-modules compiled one by one, NKI kernels launched eagerly), everything included.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["COMPILE_MODES", "LaunchPlan", "neffs_per_chunk"]

COMPILE_MODES = ("fullgraph", "eager_sharded", "peer")


@dataclass(frozen=True)
class LaunchPlan:
    """NEFF launches of one chunk: ``terms`` are ``(what, count)`` pairs summing to ``neffs``."""

    mode: str
    forwards: int
    neffs: int
    terms: tuple[tuple[str, int], ...]

    def describe(self) -> str:
        return " + ".join(f"{n} {w}" for w, n in self.terms if n) + f" = {self.neffs}"


def neffs_per_chunk(
    mode: str, *, forwards: int, collectives: int = 0, peer_neffs_per_forward: int | None = None
) -> LaunchPlan:
    """NEFF launches per chunk and per rank of ``forwards`` forwards.

    ``collectives``: host-visible collectives of the whole chunk on one rank (0 on one core; the chunk
    model counts them from its components: per layer the plan's set, per forward the head all-gather).
    ``peer_neffs_per_forward`` is required for ``"peer"``.
    """
    if mode not in COMPILE_MODES:
        raise ValueError(f"mode must be one of {COMPILE_MODES}, got {mode!r}")
    if not isinstance(forwards, int) or forwards < 1:
        raise ValueError(f"neffs_per_chunk: forwards must be an int >= 1, got {forwards!r}")
    if not isinstance(collectives, int) or collectives < 0:
        raise ValueError(f"neffs_per_chunk: collectives must be an int >= 0, got {collectives!r}")
    if mode == "peer":
        if peer_neffs_per_forward is None or peer_neffs_per_forward < 1:
            raise ValueError("neffs_per_chunk: mode 'peer' needs peer_neffs_per_forward >= 1")
        n = forwards * peer_neffs_per_forward
        return LaunchPlan(mode, forwards, n, (("peer NEFFs (fed: per forward x forwards)", n),))
    terms: list[tuple[str, int]] = []
    if mode == "fullgraph":
        terms.append(("forward graphs", forwards))
    else:
        terms.append(("graph segments between host collectives", collectives + forwards))
        terms.append(("host collective launches", collectives))
    terms.append(("sampler-update graphs", forwards))
    terms.append(("VAE decode", 1))
    return LaunchPlan(mode, forwards, sum(n for _, n in terms), tuple(terms))
