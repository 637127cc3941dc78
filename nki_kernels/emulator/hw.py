"""Hardware limits the emulator enforces (NeuronCore-v3 / trn2 defaults).

Sources (AWS Neuron SDK docs, github.com/aws-neuron/aws-neuron-sdk @ 81ce03ae26:
``nki/get-started/about/memory-hierarchy-overview.rst``, ``nki/api/nki.language.tile_size.rst``,
``nki/guides/architecture/trainium2_arch.rst``):

* ``pmax = 128`` partitions, ``nl.tile_size.pmax``.
* PSUM: 16 KiB per partition = 8 banks x 2 KiB (512 fp32); a matmul result must fit in one bank.
* ``gemm_stationary_fmax = 128``, ``gemm_moving_fmax = 512`` (``nl.tile_size``; v2/v3 limits).
* SBUF: trn2 has 28 MiB = 128 partitions x 224 KiB physically.  The usable per-partition budget defaults
  to ``224 KiB - 16 KiB - 264 B = 212,728 B``, the ``MAX_AVAILABLE_SBUF_SIZE`` nki-library uses for
  trn2 (``aws-neuron/nki-library`` @ d2ad3a5, ``core/mlp/mlp_cte/mlp_cte_constants.py``): the compiler
  keeps a reserve.  Override with ``HwConfig(sbuf_bytes_per_partition=...)``, e.g. ``192 * 1024`` for
  a conservative "24 MiB of 28 MiB" budget.
"""

from __future__ import annotations

from dataclasses import dataclass

TRN2_SBUF_PHYSICAL_BYTES_PER_PARTITION = 224 * 1024
TRN2_SBUF_COMPILER_RESERVE_BYTES = 16 * 1024 + 264


@dataclass(frozen=True)
class HwConfig:
    """Limits of one NeuronCore as enforced by the emulator (defaults: trn2 / NeuronCore-v3)."""

    pmax: int = 128
    psum_num_banks: int = 8
    psum_bank_bytes: int = 2048
    sbuf_bytes_per_partition: int = TRN2_SBUF_PHYSICAL_BYTES_PER_PARTITION - TRN2_SBUF_COMPILER_RESERVE_BYTES
    gemm_stationary_fmax: int = 128
    gemm_moving_fmax: int = 512
    transpose_pe_max: int = 128
    transpose_vector_max: int = 32
    nc_version: int = 3
    check_sbuf_capacity: bool = True
    check_psum_capacity: bool = True

    def __post_init__(self) -> None:
        for f in ("pmax", "psum_num_banks", "psum_bank_bytes", "sbuf_bytes_per_partition"):
            v = getattr(self, f)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"HwConfig.{f} must be a positive int, got {v!r}")

    @property
    def psum_bytes_per_partition(self) -> int:
        return self.psum_num_banks * self.psum_bank_bytes

    @property
    def psum_bank_fmax(self) -> int:
        return self.psum_bank_bytes // 4


TRN2 = HwConfig()
