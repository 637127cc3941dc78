"""`python -m perf.neuron_points` on a machine without a Neuron device: one line naming what is missing,
exit code 2, no row written anywhere."""

from __future__ import annotations

from pathlib import Path

import pytest

from perf import neuron_measure, neuron_points


def test_no_device_is_one_line_and_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def missing() -> None:  # what require_measure raises on any machine without the device
        raise neuron_measure.NeuronUnavailable("no Neuron device (no /dev/neuron* node)")

    monkeypatch.setattr(neuron_measure, "require_measure", missing)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "rows.jsonl"
    assert neuron_points.main(["measure-calibration", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("python -m perf.neuron_points: ") and "Neuron device" in err[0]
    assert not out.exists() and not any(tmp_path.rglob("*.jsonl"))
