"""``nki.isa.constants``: the ISA enums under the module path kernels import them from
(``from nki.isa.constants import oob_mode, dge_mode``, as aws-neuron/nki-library's kernels do); the same
objects as ``nki.isa.oob_mode`` etc."""

from __future__ import annotations

from ._enums import dge_mode, dma_engine, engine, matmul_perf_mode, nc_version, oob_mode, reduce_cmd

__all__ = ["dge_mode", "dma_engine", "engine", "matmul_perf_mode", "nc_version", "oob_mode", "reduce_cmd"]
