"""Modes typed as ``Literal`` aliases keep the same values as the runtime tuples their checks and messages
use (the types are for mypy only; a value added to one side and not the other fails here)."""

from __future__ import annotations

from typing import get_args

import pytest

from nki_kernels import op_dispatch
from perf import runner
from rolling_forcing import config, methods, schedule
from rolling_forcing.config import PipelineConfig


@pytest.mark.parametrize(
    ("values", "alias"),
    [
        (op_dispatch.BACKENDS, op_dispatch.Backend),
        (config.POSITION_MODES, config.PositionMode),
        (methods.SINK_POSITIONS, methods.SinkPositions),
        (methods.RECACHE_MODES, methods.RecacheMode),
        (methods.RNG_ORDERS, methods.RngOrder),
        (methods.ABSOLUTE_LIMITS, methods.AbsoluteLimit),
        (runner.KINDS, runner.Kind),
        (runner.STATUSES, runner.Status),
    ],
)
def test_runtime_tuple_equals_its_literal(values: tuple[str, ...], alias: object) -> None:
    assert values == get_args(alias)


def test_noise_literal_is_the_cli_enum() -> None:
    from nki_ardiff import cli_options

    assert tuple(n.value for n in cli_options.Noise) == get_args(cli_options.NoiseMode)


def test_window_kinds_are_the_literal_values() -> None:
    cfg = PipelineConfig()
    seen = {schedule.window_kind(cfg, n, w) for n in (5, 8, 12) for w in range(schedule.num_windows(cfg, n))}
    assert seen == set(get_args(schedule.WindowKind))
