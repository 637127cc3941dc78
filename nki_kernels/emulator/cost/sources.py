"""Public sources the trn2 cost model's parameters cite (keys used in ``Trn2CostParams`` metadata).

Every figure in :mod:`nki_kernels.emulator.cost` names one of these keys, or says it is fitted to named
calibration points (``perf/calibration``), or that it is unmeasured (then the parameter is a range).
"""

from __future__ import annotations

SOURCES: dict[str, str] = {
    "HW": "aws-neuron/aws-neuron-sdk@81ce03ae26 "
    "about-neuron/arch/neuron-hardware/{trainium2,neuron-core-v3}.rst",
    "TRN2-ARCH": "aws-neuron/aws-neuron-sdk@81ce03ae26 nki/guides/architecture/trainium2_arch.rst",
    "V2-ARCH": "aws-neuron/aws-neuron-sdk@81ce03ae26 nki/guides/architecture/trainium_inferentia2_arch.rst",
    "ISA": "aws-neuron/aws-neuron-sdk@77a1c5a83f nki/api/nki/isa/__init__.py (estimated instruction cost)",
    "DMA-OV": "aws-neuron/aws-neuron-sdk@81ce03ae26 nki/get-started/about/nki-dma-overview.rst "
    "(and its figure nki/img/overviews/nki-dma-intro-1.jpg)",
    "DMA-BW": "aws-neuron/aws-neuron-sdk@81ce03ae26 nki/deep-dives/nki-dma-bandwidth-guide.rst",
    "DGE": "aws-neuron/aws-neuron-sdk@81ce03ae26 nki/deep-dives/nki-dge.rst",
    "PERF": "aws-neuron/aws-neuron-sdk@81ce03ae26 nki/deep-dives/nki_perf_guide.rst",
    "NAD-BOUNDS": "aws-neuron/neuron-agentic-development@c79373205a82 skills/neuron-nki-profile-querying/"
    "references/example-bounds-analysis.md (trn2 V0/V1/V2 4096^3 bf16 matmul profiles)",
    "NAD-TE": "aws-neuron/neuron-agentic-development@1598b0609adb skills/neuron-nki-profile-querying/"
    "references/investigations/te_inefficiency.md",
    "NAD-DMA": "aws-neuron/neuron-agentic-development skills/neuron-nki-profile-querying/references/"
    "investigations/dma_efficiency.md",
    "SDK-OPT": "aws-neuron/aws-neuron-sdk@81ce03ae26 nki/guides/tutorials/kernel-optimization.rst and its "
    "profile screenshots nki/img/how-to/v{2,3,4,5}-full.png",
    "CS149": "xaviergonzalez/asst4-trainium2@d1552616 writeup.md, part1/kernels.py (trn2.3xlarge, "
    "nki.benchmark p99), and the neuron-profile dumps of the same assignment's kernels",
    "CS149-PROF": "neuron-profile 'view --output-format summary-text' of the same assignment's kernels on "
    "trn2.3xlarge (compiler 2.21.18209, profiler 2.25.145), published as text: rishic3/asst4-trainium2@"
    "ef7e4ef89d99 part1/profile_view_{transpose_1024,stream_256k_fd1k,stream_256k_fd2k}.txt and "
    "chenhzhu/asst4-trainium2@e30a10f5368f part1/{transpose_1024_perf,profile_1k,profile_2k}.txt",
    "EXPLORER": "aws-neuron/aws-neuron-sdk@81ce03ae26 tools/neuron-explorer/{glossary,"
    "profile-schema-reference}.rst (EVENT_SEMAPHORE: 'Semaphore increment or wait'; engine active time "
    "'excluding semaphore waits')",
}
