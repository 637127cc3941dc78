"""Shared pytest configuration: hypothesis profiles and backend hygiene."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, Phase, settings

settings.register_profile(
    "ci",
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True,
)
settings.register_profile("dev", max_examples=40, deadline=None)
# tools/mutate.py: the CI examples, but a failing example is reported as found (no shrinking, no database)
settings.register_profile(
    "mutate",
    parent=settings.get_profile("ci"),
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    database=None,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def model_builds(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that grows by one for every ``CausalWanModel`` built during the test (the class in
    ``rolling_forcing.model`` is replaced by a counting subclass): an option check must refuse bad input
    before any build."""
    import rolling_forcing.model as model_mod

    built: list[int] = []

    class Spy(model_mod.CausalWanModel):
        def __init__(self, *args, **kwargs) -> None:
            built.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(model_mod, "CausalWanModel", Spy)
    return built


@pytest.fixture(scope="session")
def neuron_device():
    """The ``torch_xla`` device of the ``neuron`` tier, or a skip saying what is missing
    (:func:`tests.neuron_helpers.device_or_skip`; nothing is probed unless a test asks)."""
    from tests.neuron_helpers import device_or_skip

    return device_or_skip()
