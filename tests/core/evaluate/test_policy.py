"""The serving policy: one typed, validated record of the bars, and the one comparison every bar uses."""

from __future__ import annotations

import math

import numpy as np
import pytest

from diffusion_gr2.core.evaluate.metrics import paired_bootstrap
from diffusion_gr2.core.evaluate.policy import TOLERANCE, Policy, clears

FIELDS = ["level", "min_unforced_rate", "min_speed_ratio", "choice_margin", "gate_margin", "prerank_margin"]


def test_the_policy_holds_the_floors_the_margins_and_the_level() -> None:
    """conf/base's values (tests/test_config.py ties the defaults to conf/base)."""
    assert Policy().as_record() == {
        "level": 0.95,
        "min_unforced_rate": 0.5,
        "min_speed_ratio": 1.0,
        "choice_margin": 0.03,
        "gate_margin": 0.05,
        "prerank_margin": 0.05,
    }
    with pytest.raises(AttributeError):
        Policy().level = 0.9  # type: ignore[misc]  # frozen: no consumer moves a bar


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("level", 0.0),
        ("level", 1.0),
        ("level", 95.0),  # a percentage, not a share
        ("level", math.nan),
        ("min_unforced_rate", -0.1),
        ("min_unforced_rate", 1.01),
        ("min_speed_ratio", -1.0),
        ("min_speed_ratio", math.inf),
        ("choice_margin", 1.5),
        ("gate_margin", -2.0),
        ("prerank_margin", math.nan),
    ],
)
def test_a_field_out_of_range_is_refused_naming_it(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=rf"^policy\.{field}: "):
        Policy(**{field: value})


def test_from_params_needs_every_field_and_no_other() -> None:
    section = Policy().as_record()
    assert Policy.from_params(section) == Policy()
    with pytest.raises(ValueError, match=r"unknown keys \['margin'\], missing keys \[\]"):
        Policy.from_params(section | {"margin": 0.05})
    with pytest.raises(ValueError, match=r"unknown keys \[\], missing keys \['level'\]"):
        Policy.from_params({k: v for k, v in section.items() if k != "level"})
    with pytest.raises(ValueError, match=r"policy\.level"):
        Policy.from_params(section | {"level": 0.0})


@pytest.mark.parametrize("bar", [0.5, 1.0, -0.03, -0.05, 0.0])
def test_clears_is_at_least_up_to_the_tolerance_and_no_further(bar: float) -> None:
    """`>=`, not `>`: the bar itself and the lowest figure the tolerance admits clear it; the next
    float below does not."""
    assert clears(bar, bar)
    assert clears(bar - TOLERANCE, bar)
    assert not clears(float(np.nextafter(bar - TOLERANCE, -math.inf)), bar)
    assert not clears(None, bar) and not clears(math.nan, bar)


def test_every_paired_interval_states_its_level() -> None:
    """No default to drift: `paired_bootstrap` refuses to run without a level."""
    with pytest.raises(TypeError, match="level"):
        paired_bootstrap([1.0, 0.0], [0.0, 0.0])  # type: ignore[call-arg]
