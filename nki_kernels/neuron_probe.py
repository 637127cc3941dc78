"""Is there a Neuron device and a real NKI here? One probe answers for the ``neuron`` test tier and the
measured-latency benchmark (``perf/neuron_measure.py``), with a reason string when the answer is no.

Nothing runs at import. :func:`probe` looks, without side effects beyond importing the packages it checks:

* **device**: the Neuron driver exposes each NeuronDevice as a character device ``/dev/neuron<N>`` (the
  Neuron docs list them with ``ls /dev/neuron*``, e.g. the container guide
  https://awsdocs-neuron.readthedocs-hosted.com/en/latest/deploy/environments/docker-setup.html);
* **nki**: the real standalone ``nki`` package (NKI 0.6, from https://pip.repos.neuron.amazonaws.com) imports
  and has ``nki.jit``, ``nki.language`` and ``nki.isa``; ``NKI_ARDIFF_BACKEND=emulator`` (which makes the
  kernels' shim pick the bundled emulator, :mod:`nki_kernels._nki`) counts as *no nki*;
* **torch_xla**: imports (the kernels' PyTorch launch: ``torch.Tensor`` arguments on ``torch_xla.device()``,
  per ``nki.jit``'s documented framework detection);
* **profiler**: ``neuron-explorer`` (or the deprecated ``neuron-profile``, same interface) is on ``PATH``
  (package ``aws-neuronx-tools``).

The test tier needs device + nki + torch_xla; the measure path needs device + nki + profiler.
"""

from __future__ import annotations

import glob
import importlib
import os
import shutil
from dataclasses import dataclass
from typing import Any

__all__ = ["DEVICE_GLOB", "PROFILERS", "NeuronProbe", "probe"]

DEVICE_GLOB = "/dev/neuron*"
"""Where the Neuron driver puts one character device per NeuronDevice."""

PROFILERS = ("neuron-explorer", "neuron-profile")
"""Profiler executables, preferred first (``neuron-profile`` is the deprecated name of the same CLI)."""

_NEEDS = ("device", "nki", "torch_xla", "profiler")


@dataclass(frozen=True)
class NeuronProbe:
    """What :func:`probe` found. Empty strings / tuples mean *absent*; ``*_error`` says why.

    Attributes:
        devices: paths of the Neuron device nodes found (``/dev/neuron0`` ...).
        nki_version: version of the real ``nki`` package, ``"unknown"`` when it imports but has no
            distribution metadata, ``""`` when it is not usable.
        nki_error: why ``nki`` is not usable (``""`` when it is).
        torch_xla_error: why ``torch_xla`` does not import (``""`` when it does).
        profiler: path of ``neuron-explorer`` / ``neuron-profile``, ``""`` when neither is on PATH.
    """

    devices: tuple[str, ...]
    nki_version: str
    nki_error: str
    torch_xla_error: str
    profiler: str

    def missing(self, needs: tuple[str, ...] = ("device", "nki", "torch_xla")) -> list[str]:
        """One sentence per missing requirement among ``needs`` (subset of device, nki, torch_xla,
        profiler), in that order; empty when all are present."""
        bad = [n for n in needs if n not in _NEEDS]
        if bad:
            raise ValueError(f"needs: unknown requirement(s) {bad}; known: {_NEEDS}")
        out = []
        if "device" in needs and not self.devices:
            out.append(f"no Neuron device (no {DEVICE_GLOB} node: not a Trainium/Inferentia host)")
        if "nki" in needs and not self.nki_version:
            out.append(f"the real `nki` package is not usable ({self.nki_error})")
        if "torch_xla" in needs and self.torch_xla_error:
            out.append(f"`torch_xla` is not importable ({self.torch_xla_error})")
        if "profiler" in needs and not self.profiler:
            out.append(f"no Neuron profiler on PATH ({' / '.join(PROFILERS)}, package aws-neuronx-tools)")
        return out

    def reason(self, needs: tuple[str, ...] = ("device", "nki", "torch_xla")) -> str:
        """``""`` when everything in ``needs`` is present, else the missing pieces joined by ``"; "``."""
        return "; ".join(self.missing(needs))


def _nki_status() -> tuple[str, str]:
    forced = os.environ.get("NKI_ARDIFF_BACKEND", "").strip().lower()
    if forced == "emulator":
        return "", "NKI_ARDIFF_BACKEND=emulator forces the bundled emulator"
    try:
        mod: Any = importlib.import_module("nki")
        importlib.import_module("nki.language")
        importlib.import_module("nki.isa")
    except ImportError as exc:
        return "", f"{type(exc).__name__}: {exc}; install it from https://pip.repos.neuron.amazonaws.com"
    if not callable(getattr(mod, "jit", None)):
        return "", "`nki` imports but has no nki.jit (the PyPI placeholder, not the Neuron package?)"
    try:
        from importlib.metadata import PackageNotFoundError, version

        return version("nki"), ""
    except PackageNotFoundError:
        return "unknown", ""


def _import_error(name: str) -> str:
    try:
        importlib.import_module(name)
    except ImportError as exc:
        return f"{type(exc).__name__}: {exc}"
    return ""


def probe(device_glob: str = DEVICE_GLOB) -> NeuronProbe:
    """Look for a Neuron device, the real ``nki``, ``torch_xla`` and the profiler CLI (see module doc).

    ``device_glob``: pattern of the device nodes (tests point it at a temporary directory).
    """
    version, err = _nki_status()
    prof = next((p for p in (shutil.which(n) for n in PROFILERS) if p), "")
    return NeuronProbe(
        devices=tuple(sorted(glob.glob(device_glob))),
        nki_version=version,
        nki_error=err,
        torch_xla_error=_import_error("torch_xla"),
        profiler=prof,
    )
