"""The decoder against its golden dump: every configuration the pipelines, operating points and
benchmarks use, token for token as the decoder wrote it before its split into strategies (`golden.py`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.core.decode import golden
from tests.core.model.tiny import DEVICE

GOLDEN = Path(__file__).with_name("golden_decode.json")
pytestmark = pytest.mark.skipif(
    DEVICE.type != "cpu", reason="recorded on the CPU: GPU kernels sum in another order"
)


@pytest.fixture(scope="module")
def want() -> dict[str, Any]:
    return json.loads(GOLDEN.read_text())


@pytest.fixture(scope="module")
def world() -> golden.World:
    """The recorded models, at the suite's own thread count: recorded with one thread, the dump
    holds under any count (`golden.logprob_tolerance`)."""
    return golden.world()


@pytest.fixture(scope="module")
def tolerance(world: golden.World) -> float:
    return golden.tolerance_of(world)


def test_every_case_is_recorded(want: dict[str, Any]) -> None:
    assert sorted(want) == sorted(golden.cases())


def test_the_cases_exercise_what_they_name(want: dict[str, Any]) -> None:
    """The dump can catch a change in each feature: each one changes the record of its case."""

    def tokens(name: str) -> list[list[int]]:
        return [row["tokens"] for row in want[name]]

    def nfe(name: str) -> int:
        return sum(row["nfe"] for row in want[name])

    for g in ("free", "plain"):
        assert nfe(f"dm0.4/{g}") < nfe(f"dm0.75/{g}") < sum(len(t) for t in tokens(f"dm0.75/{g}"))
        assert tokens(f"dm0.75/sid-standin/{g}") != tokens(f"dm0.75/{g}")  # the SID gate
        assert tokens(f"dm0.75/sid/copy/{g}") != tokens(f"dm0.75/sid/{g}")  # lossy copy drafts
        assert nfe(f"dm0.75/sid/separate/{g}") != nfe(f"dm0.75/sid/{g}")  # fused
    assert tokens("dm0.75/sid-standin-list/plain") != tokens("dm0.75/sid-standin/plain")  # its scope
    assert tokens("dm0.75/sid/window4/plain") != tokens("dm0.75/sid/plain") or nfe(
        "dm0.75/sid/window4/plain"
    ) != nfe("dm0.75/sid/plain")
    for who in ("ar+pld3", "ar+dm-draft", "ar+twin-draft"):  # lossless: plain AR's tokens, fewer forwards
        assert tokens(f"{who}/plain/b6") == tokens("ar/plain/b6")
        assert nfe(f"{who}/free/b6") < nfe("ar/free/b6")
    assert nfe("ar/plain/b1") < nfe("ar/plain/nojump/b1")  # AR jump-forward
    assert sum(row["forced"] for row in want["ar/plain/b6"]) > 0  # the grammar corrects the model


@pytest.mark.parametrize("name", sorted(golden.cases()))
def test_decodes_as_recorded(world: golden.World, want: dict[str, Any], tolerance: float, name: str) -> None:
    got = golden.record(golden.run(world, golden.cases()[name]))
    assert list(golden.differences({name: got}, {name: want[name]}, tolerance)) == []


def test_the_tolerance_is_float32_rounding_not_slack(tolerance: float) -> None:
    """Wide enough for another CPU's sums (5.7e-6 measured across kernel paths and thread counts),
    still far below what any change of the maths does (next test)."""
    assert 2e-5 < tolerance < 1e-3


@pytest.mark.parametrize("name", ["dm0.75/plain", "ar/plain/b1"])
def test_a_small_change_of_the_model_is_caught(
    world: golden.World, want: dict[str, Any], tolerance: float, name: str
) -> None:
    """A 0.1% change of the LM head is caught, by its log-probs alone where the tokens and steps hold."""
    case = golden.cases()[name]
    head = world.models[case.model].lm_head.weight
    original = head.detach().clone()
    try:
        with torch.no_grad():
            head.mul_(1.001)
        got = golden.record(golden.run(world, case))
    finally:
        with torch.no_grad():
            head.copy_(original)
    found = list(golden.differences({name: got}, {name: want[name]}, tolerance))
    assert any("log-probs differ" in line for line in found), found
