"""End-to-end performance model: modelled fps, MFU, time to first frame and HBM of Rolling Forcing on trn2.

``python -m perf.e2e`` (``rolling-forcing bench e2e``) models one steady-state chunk of the stream on
Trainium2 at both ends of the unmeasured parameters and beside the measured peer (the open Rolling
Forcing port), prints the comparison and writes ``perf/REPORT.md``, ``perf/results/e2e.jsonl`` and a PNG.
Every figure it produces is **modelled**; published figures of other systems are marked as such.  Method:
``docs/e2e_model.md``.  Modules, in dependency order:

* :mod:`perf.e2e.params`: :class:`E2EParams` (frozen, sourced) with :class:`Range` parameters and ends;
* :mod:`perf.e2e.kernels`: the kernel-provider seam (traced NKI kernels through the cost model, or the
  analytic fallback);
* :mod:`perf.e2e.components`: per-forward and VAE components;
* :mod:`perf.e2e.launches`: NEFFs per chunk from how the pipeline compiles;
* :mod:`perf.e2e.weights`: FSDP / TP-linear communication;
* :mod:`perf.e2e.chunk`: the chunk model (components + kernel fixed costs + barriers + NEFF launches);
* :mod:`perf.e2e.peer`: the peer's measured figures and configurations;
* :mod:`perf.e2e.peer_attention`: the peer's attention design in NKI 0.6 and its D-major permutes;
* :mod:`perf.e2e.peer_kernels`: :class:`~perf.e2e.peer_kernels.PeerKernels`, the provider of the peer rows;
* :mod:`perf.e2e.run`, :mod:`perf.e2e.report`, :mod:`perf.e2e.plots`, :mod:`perf.e2e.cli`.
"""

from perf.e2e.chunk import ChunkModel, chunk_model, steady_forwards, summarize, warmup_forwards
from perf.e2e.cli import main
from perf.e2e.components import GROUPS, Component, Forward, forward_components, vae_components, vae_conv_flops
from perf.e2e.kernels import (
    AnalyticKernels,
    KernelCost,
    KernelProvider,
    TracedKernels,
    default_kernel_provider,
)
from perf.e2e.launches import COMPILE_MODES, LaunchPlan, neffs_per_chunk
from perf.e2e.params import ENDS, E2EParams, EndPoint, Range
from perf.e2e.peer import PEER_CONFIGS, PEER_MEASURED, PUBLISHED
from perf.e2e.run import E2EResult, run_model
from perf.e2e.weights import WEIGHT_VARIANTS, all_reduce_s, fsdp_gather, tp_linear_comm

__all__ = [
    "E2EParams",
    "Range",
    "ENDS",
    "EndPoint",
    "KernelCost",
    "KernelProvider",
    "AnalyticKernels",
    "TracedKernels",
    "default_kernel_provider",
    "GROUPS",
    "Component",
    "Forward",
    "ChunkModel",
    "chunk_model",
    "forward_components",
    "vae_components",
    "vae_conv_flops",
    "steady_forwards",
    "warmup_forwards",
    "summarize",
    "COMPILE_MODES",
    "LaunchPlan",
    "neffs_per_chunk",
    "all_reduce_s",
    "fsdp_gather",
    "tp_linear_comm",
    "WEIGHT_VARIANTS",
    "PUBLISHED",
    "PEER_CONFIGS",
    "PEER_MEASURED",
    "E2EResult",
    "run_model",
    "main",
]
