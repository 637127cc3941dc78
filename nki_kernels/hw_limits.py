"""Hardware limits the kernels size their tiles by, named after their ``nl.tile_size`` fields.

The kernels write these as Python ints, not as ``nl.tile_size.<field>`` reads: tile shapes, loop bounds and
the SBUF budget arithmetic are evaluated while the kernel is traced, and NKI needs plain Python ints for
shapes (nki-library writes ``P_MAX = 128`` for the same reason: github.com/aws-neuron/nki-library,
``src/nkilib_src/nkilib/core/cumsum/cumsum.py``). The values are the trn2 (NeuronCore-v3) ones; the
emulator's :class:`~nki_kernels.emulator.hw.HwConfig` defaults carry the same numbers and enforce them.

Sources (AWS Neuron docs, NKI 0.6): ``nki.language.tile_size``
(https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/api/generated/nki.language.tile_size.html),
``nki.isa.nc_matmul`` and ``nki.isa.dma_transpose`` in the same API reference
(https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/api/nki.isa.html), and the Trainium2
architecture guide
(https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/guides/architecture/trainium2_arch.html).

Pure constants: no imports, no NKI calls.
"""

from __future__ import annotations

PMAX = 128
"""Partitions of a tile (``nl.tile_size.pmax``): SBUF and PSUM have 128 partitions."""

PSUM_BANK_FMAX = 512
"""fp32 elements per partition in one PSUM bank, 2 KiB (``nl.tile_size.psum_bank_fmax``; its old name
``psum_fmax`` is deprecated since NKI 0.4.0). One matmul result or one accumulation group fits in one bank."""

GEMM_STATIONARY_FMAX = 128
"""Largest free size of the TensorE stationary operand (``nl.tile_size.gemm_stationary_fmax``)."""

GEMM_MOVING_FMAX = 512
"""Largest free size of the TensorE moving operand on trn2 (``nl.tile_size.gemm_moving_fmax``)."""

HWDGE_ROWS = 16
"""Source rows of one 2-D hardware-DGE ``dma_transpose`` (``nki.isa.dma_transpose``, NKI 0.6:
``src.shape[0] == 16`` for 2-D; 3-D/4-D sources need ``src.shape[0]`` in {1, 2, 4, 8, 16} and
``(src.shape[0] * src.shape[-2]) % 16 == 0``)."""

__all__ = ["GEMM_MOVING_FMAX", "GEMM_STATIONARY_FMAX", "HWDGE_ROWS", "PMAX", "PSUM_BANK_FMAX"]
