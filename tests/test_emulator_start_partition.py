"""The start-partition rule (NeuronCore architecture guide, "Data streaming"): the pure rule and its check
on every compute-engine instruction of the emulator (operands and destination; DMA exempt), including the
trace-only fast paths that cache validation."""

from __future__ import annotations

import pytest

from nki_kernels.emulator import start_partition as sp
from nki_kernels.emulator.errors import PartitionLimitError, StartPartitionError

pytestmark = pytest.mark.emulator


def _guide(n: int) -> set[int]:
    """The guide's three clauses, written out literally (independent of the module's modular form)."""
    if 64 < n <= 128:
        starts = {0}
    elif 32 < n <= 64:
        starts = {0, 64}
    elif 0 < n <= 32:
        starts = {0, 32, 64, 96}
    else:
        raise AssertionError(n)
    return {s for s in starts if s + n <= 128}


def test_rule_matches_the_guide_for_every_start_and_size() -> None:
    for n in range(1, 129):
        assert set(sp.allowed_starts(n)) == _guide(n), n
        for start in range(0, 128):
            assert sp.start_ok(start, n) == (start in _guide(n)), (start, n)


@pytest.mark.parametrize(
    ("n", "starts"),
    [
        (1, (0, 32, 64, 96)),
        (32, (0, 32, 64, 96)),  # boundary: 32 partitions are a quadrant access
        (33, (0, 64)),  # boundary: 33 is a half access
        (64, (0, 64)),
        (65, (0,)),  # boundary: more than 64 must start at 0
        (128, (0,)),
    ],
)
def test_rule_boundaries(n: int, starts: tuple[int, ...]) -> None:
    assert sp.allowed_starts(n) == starts
    for s in range(128):
        assert sp.start_ok(s, n) == (s in starts)


def test_rule_rejects_accesses_past_the_last_partition_and_bad_sizes() -> None:
    assert not sp.start_ok(96, 33) and not sp.start_ok(64, 65) and not sp.start_ok(-32, 8)
    with pytest.raises(ValueError, match="num_partitions"):
        sp.alignment(0)
    with pytest.raises(ValueError, match="num_partitions"):
        sp.alignment(129)
    with pytest.raises(ValueError, match="pmax"):
        sp.alignment(4, pmax=30)
    assert issubclass(StartPartitionError, PartitionLimitError)


def test_rule_text_names_the_clause() -> None:
    assert sp.rule_for(56) == "an access of 33-64 partitions must start at partition 0/64"
    assert sp.rule_for(96) == "an access of more than 64 partitions must start at partition 0"
    assert sp.rule_for(24) == "an access of 32 or fewer partitions must start at partition 0/32/64/96"
