"""rolling_forcing.tensor_io: the finite check and the safetensors read shared by the checkpoint loader and
the prompt-embedding loader, each raising the exception type its caller documents."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from rolling_forcing.checkpoint import CheckpointError, check_tensors, read_safetensors
from rolling_forcing.tensor_io import check_finite, load_safetensors
from rolling_forcing.text import load_prompt_embeds, validate_prompt_embeds


def test_check_finite_counts_nan_and_inf() -> None:
    t = torch.zeros(3, 5)
    check_finite(t, "x", ValueError)  # finite: no error
    t[0, 1], t[2, 4], t[1, 0] = float("nan"), float("inf"), float("-inf")
    with pytest.raises(KeyError, match=r"^'x has 3 non-finite values \(NaN/inf\)'$"):
        check_finite(t, "x", KeyError)


def test_both_callers_keep_their_type_and_wording() -> None:
    bad = torch.ones(1, 4, 8)
    bad[0, 2, 3] = float("nan")
    with pytest.raises(CheckpointError, match=r"^ckpt: tensor 'w' has 1 non-finite values \(NaN/inf\)$"):
        check_tensors({"w": bad}, "ckpt")
    with pytest.raises(ValueError, match=r"^prompt_embeds has 1 non-finite values \(NaN/inf\)$"):
        validate_prompt_embeds(bad, 4, 8)


def test_load_safetensors_round_trip_and_corrupt_file(tmp_path: Path) -> None:
    good = tmp_path / "good.safetensors"
    want = torch.arange(32.0).reshape(1, 4, 8)
    save_file({"prompt_embeds": want}, str(good))
    assert torch.equal(load_safetensors(good, ValueError)["prompt_embeds"], want)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(good.read_bytes()[:40])  # truncated: the header promises more than the file holds
    with pytest.raises(CheckpointError, match="is not a readable .safetensors file"):
        read_safetensors(bad)
    with pytest.raises(ValueError, match="is not a readable .safetensors file"):
        load_prompt_embeds(bad, 4, 8)
