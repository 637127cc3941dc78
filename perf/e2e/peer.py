"""The measured peer (the open Rolling Forcing port on trn2) and the published figures quoted beside ours.

:data:`PEER_MEASURED` holds the port's *published* measurements (measured by them, not by us);
:data:`PEER_CONFIGS` the configurations modelled side by side with them: merged and two-pass, 480x832
and 480x640, TP4xSP2 on 8 cores (one chip) and TP4xSP4 on 16 (two chips, LNC=1).  The port shards its
linears Megatron-style inside the TP group (``weights="tp_linear"``) and launches ~370 NEFFs per rank per
forward (``compile_mode="peer"``).  Its merged forward is what it measured; its two-pass rows have no
measured figure.  The end-to-end calibration: predicted / measured fps at 480x832, TP4xSP2, merged,
target within x1.3.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "PEER_PRESET",
    "PeerMeasured",
    "PeerConfig",
    "PEER_MEASURED",
    "PEER_CONFIGS",
    "PUBLISHED",
    "CALIBRATION_BAND",
]

PEER_PRESET = "wan2.1-1.3b"
"""The peer runs Wan2.1-T2V-1.3B."""

CALIBRATION_BAND = 1.3
"""The end-to-end calibration target: predicted / measured peer fps within x1.3 (the project's calibration
target for the end-to-end model, see docs/e2e_model.md)."""

_RF = "github.com/yahavb/rolling_forcing"


@dataclass(frozen=True)
class PeerMeasured:
    """A published measurement of the Rolling Forcing port: fps (median) and its spread."""

    height: int
    width: int
    cores: int
    variant: str
    fps: float
    fps_low: float
    fps_high: float
    source: str
    note: str = ""


@dataclass(frozen=True)
class PeerConfig:
    """One modelled configuration of the peer (``plan`` is the port's layout, checked against ours)."""

    height: int
    width: int
    cores: int
    variant: str
    plan: str

    @property
    def key(self) -> tuple[int, int, int, str]:
        return (self.height, self.width, self.cores, self.variant)


PEER_MEASURED: tuple[PeerMeasured, ...] = (
    PeerMeasured(
        480,
        832,
        8,
        "merged",
        8.1,
        7.8,
        8.6,
        f"{_RF} .claude/skills/rolling-forcing-trn2-benchmark/SKILL.md; docs/compilation_pattern.md",
    ),
    PeerMeasured(
        480, 640, 8, "merged", 10.58, 10.58, 10.58, f"{_RF} docs/PAPER_parallelism_neuron.md @ 264f5a8"
    ),
    PeerMeasured(
        480,
        640,
        16,
        "merged",
        13.95,
        13.95,
        13.95,
        f"{_RF} docs/ROOFLINE_RF_1_3B.md (16 physical cores, LNC1)",
        "DiT ~700 ms + VAE ~135 ms per chunk",
    ),
)

PEER_CONFIGS: tuple[PeerConfig, ...] = tuple(
    PeerConfig(h, w, c, v, "TP4xSP2" if c == 8 else "TP4xSP4")
    for c in (8, 16)
    for (h, w) in ((480, 832), (480, 640))
    for v in ("merged", "two_pass")
)


def measured_for(cfg: PeerConfig) -> PeerMeasured | None:
    """The peer's measurement of ``cfg``, if it published one."""
    for pm in PEER_MEASURED:
        if (pm.height, pm.width, pm.cores, pm.variant) == cfg.key:
            return pm
    return None


PUBLISHED: tuple[dict[str, str], ...] = (
    {
        "system": "Published Trainium result (Amazon article; not found, unverified)",
        "figure": "> 16 fps on one trn2 chip, 11 GB HBM",
        "kind": "published (unverified)",
        "source": "cited by the project brief; no public copy found",
    },
    {
        "system": "yahavb/rolling_forcing, TP4xSP2 on 8 cores (one chip), merged forward, 480x832",
        "figure": "~8.1 fps (7.8-8.6); ~24-28 % dense-FLOP MFU of one chip (242 TFLOP per 12-frame chunk)",
        "kind": "published (measured by them)",
        "source": f"{_RF} .claude/skills/rolling-forcing-trn2-benchmark/SKILL.md, "
        "docs/compilation_pattern.md",
    },
    {
        "system": "yahavb/rolling_forcing, TP4xSP2 on 8 cores, 480x640 / 480x512",
        "figure": "10.58 fps (480x640, CP2) / 10.80 fps (480x512)",
        "kind": "published (measured by them)",
        "source": f"{_RF} docs/PAPER_parallelism_neuron.md @ 264f5a8, VERIFIED_14FPS_BASELINE.md",
    },
    {
        "system": "yahavb/rolling_forcing, TP4xCP4 on 16 cores (two chips, LNC1), 480x640",
        "figure": "13.95 fps",
        "kind": "published (measured by them)",
        "source": f"{_RF} docs/ROOFLINE_RF_1_3B.md",
    },
    {
        "system": "Physical limit, Wan2.1-1.3B 480x832",
        "figure": "~33 fps: ~242 TFLOP per 12-frame chunk at 667 dense bf16 TFLOPS",
        "kind": "derived",
        "source": "dense-FLOP count (docs/e2e_model.md) / trn2 chip peak (AWS Neuron docs trainium2.rst)",
    },
)
