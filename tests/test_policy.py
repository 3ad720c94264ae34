"""One serving policy: conf holds each bar once (`policy`), the nodes that decide (the operating
point's choice, the registration gate, and the comparisons beside them) read that block, and every
paired interval they report is a 95% one.

The level is pinned against the slow reference loop of the paired bootstrap
(tests/core/evaluate/test_paired_bootstrap_reference.py): a 90% interval planted in conf, in the
policy's default, in the gate, in the operating point's search or in the comparisons fails here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from diffusion_gr2.core.evaluate.policy import Policy
from diffusion_gr2.core.rank import point_search
from diffusion_gr2.core.rank.operating_point import PRERANK, paired_key
from diffusion_gr2.core.rank.point_search import OperatingPointConfig, Reference, search_operating_point
from diffusion_gr2.core.rank.rerank import SERVED_DIFFUSION
from diffusion_gr2.core.registry.gate import GateConfig, decide
from diffusion_gr2.parameters import load_parameters
from diffusion_gr2.pipelines.evaluation.nodes import compare_to_baselines
from diffusion_gr2.pipelines.retrain import nodes as retrain_nodes
from tests.core.evaluate.test_paired_bootstrap_reference import loop_interval

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
ENVS = [
    None,
    *sorted(p.name for p in CONF.iterdir() if p.is_dir() and p.name not in {"base", "local", "accelerate"}),
]
BAR_NAMES = set(Policy().as_record()) | {"budget", "margin"}  # the policy's, and what they were called


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        out |= _flat(value, name) if isinstance(value, dict) and value else {name: value}
    return out


@pytest.mark.parametrize("env", ENVS)
def test_conf_holds_each_bar_once_in_the_policy_block(
    env: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No second copy of a floor, a margin or the level to drift from the first (the operating point's
    and the gate's sections refuse such keys too: `OperatingPointConfig`, `GateConfig`)."""
    monkeypatch.delenv("DIFFUSION_GR2_PRETRAINED", raising=False)
    params = load_parameters(env, CONF)
    elsewhere = sorted(
        k for k in _flat(params) if k.rsplit(".", 1)[-1] in BAR_NAMES and not k.startswith("policy.")
    )
    assert elsewhere == []
    policy = Policy.from_params(params["policy"])
    assert policy.level == 0.95  # every environment decides at 95%
    assert (
        "policy" not in params["inference"]["operating_point"] and "policy" not in params["retrain"]["gate"]
    )


def _node(pipeline: Any, name: str) -> Any:
    return next(n for n in pipeline.nodes if n.name == name)


def test_the_deciding_nodes_read_the_policy_block() -> None:
    from diffusion_gr2.pipelines.evaluation.pipeline import create_pipeline as evaluation
    from diffusion_gr2.pipelines.inference.pipeline import create_pipeline as inference
    from diffusion_gr2.pipelines.retrain.pipeline import retrain_pipeline

    retrain = retrain_pipeline()
    deciders = [
        _node(inference(), f"rerank_{SERVED_DIFFUSION}"),
        _node(retrain, "choose_operating_point"),
        _node(retrain, "run_gate"),
        _node(evaluation(), "compare_to_baselines"),
    ]
    assert all("params:policy" in n.inputs for n in deciders), [(n.name, n.inputs) for n in deciders]


def test_the_operating_point_and_the_gate_get_the_same_policy_from_one_block(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The retrain's two deciders, fed the run's `params:policy`: both hold that one policy, and a
    bar moved in the block moves for both."""
    params = load_parameters(conf_source=CONF)
    seen: dict[str, Any] = {}

    def search(*args: Any) -> Any:
        seen["operating_point"] = next(a for a in args if isinstance(a, OperatingPointConfig)).policy
        return point_search.OperatingPointSearch(pd.DataFrame(), {"tau": None})

    def gate(versions: Any, requests: Any, config: GateConfig, *rest: Any, **kwargs: Any) -> dict[str, Any]:
        seen["gate"] = config.policy
        return {"decision": "refuse", "reasons": "", "numbers": {}, "challenger_version": None}

    monkeypatch.setattr(retrain_nodes, "search_beside_reference", search)
    monkeypatch.setattr(retrain_nodes, "gate_and_promote", gate)
    monkeypatch.setattr(retrain_nodes.model_card, "publish_cards", lambda result: {})
    retrain = params["retrain"] | {"lock_file": str(tmp_path / ".lock"), "shadow": {"enabled": False}}
    requests = pd.DataFrame({"split": [], "point": [], "user_id": []})
    for block in (params["policy"], params["policy"] | {"min_unforced_rate": 0.7, "prerank_margin": 0.02}):
        retrain_nodes.choose_operating_point(None, None, requests, None, params["inference"], block)
        retrain_nodes.run_gate({}, pd.DataFrame(), retrain, params["serving"], block)
        assert seen["operating_point"] == seen["gate"] == Policy.from_params(block)


# --- the level: every paired interval that decides is the 95% one of the reference loop ----------

USERS = np.repeat(np.arange(60), 3).tolist()  # 60 users, 3 points each
POINTS = [0, 1, 2] * 60
RNG = np.random.default_rng(11)
MODEL, TEACHER, PRE = (RNG.binomial(1, p, 180).astype(float).tolist() for p in (0.35, 0.3, 0.25))


def _expected(a: list[float], b: list[float], n_boot: int, seed: int) -> tuple[float, float]:
    """The 95% interval of the reference loop; the test's sample tells it apart from the 90% one."""
    at_95 = loop_interval(a, b, USERS, n_boot, seed, 0.95)
    assert at_95 != pytest.approx(loop_interval(a, b, USERS, n_boot, seed, 0.90), abs=1e-6)
    return at_95


def test_the_gates_paired_intervals_are_95_percent() -> None:
    policy = Policy.from_params(load_parameters(conf_source=CONF)["policy"])
    config = GateConfig(n_boot=400, policy=policy)

    def side(hits: list[float]) -> dict[str, Any]:
        return {
            "n": 180.0,
            "hits": hits,
            "recall@1": float(np.mean(hits)),
            "valid_rate": 1.0,
            "unforced_rate": 0.9,
        }

    challenger = side(MODEL) | {"output_tokens_per_s": 200.0}
    teacher = side(TEACHER) | {"output_tokens_per_s": 100.0}
    numbers = decide(challenger, None, teacher, side(PRE), config, USERS)["numbers"]
    for name, other in (("prerank", PRE), ("teacher", TEACHER)):
        low, high = _expected(MODEL, other, 400, 0)
        assert (numbers[f"recall@1_vs_{name}.low"], numbers[f"recall@1_vs_{name}.high"]) == (
            pytest.approx(low, abs=1e-12),
            pytest.approx(high, abs=1e-12),
        )


def _rows(hits: list[float], system: str, tau: float | None) -> pd.DataFrame:
    """Validation rows whose served ranking has the target (1) first when it hits."""
    return pd.DataFrame(
        {
            "split": "valid",
            "system": system,
            "tau": np.nan if tau is None else tau,
            "window": np.nan,
            "user_id": USERS,
            "point": POINTS,
            "target": 1,
            "prerank": [[1, 2]] * len(hits),
            "ranking": [[1, 2] if h else [2, 1] for h in hits],
            "valid": True,
        }
    )


def test_the_operating_points_paired_intervals_are_95_percent(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the search, conf/base's operating point and policy: the candidate's paired figures
    against ar_rl and against the pre-rank (the retriever's order on the same requests)."""
    params = load_parameters(conf_source=CONF)
    config = OperatingPointConfig.from_params(
        params["inference"]["operating_point"], Policy.from_params(params["policy"])
    )
    rows = _rows(MODEL, SERVED_DIFFUSION, 0.9)
    candidate = {"tau": 0.9, "window": None, "recall@1": float(np.mean(MODEL)), "unforced_rate": 0.9}
    monkeypatch.setattr(point_search, "_decode_candidates", lambda *args: (rows, [candidate]))
    requests = pd.DataFrame(
        {"user_id": USERS, "point": POINTS, "target": 1, "candidates": [[1, 2] if h else [2, 1] for h in PRE]}
    )
    reference = Reference(_rows(TEACHER, "ar_rl", None), None)  # no model: refused after pairing
    untimed = lambda *args, **kwargs: pytest.fail("no reference model: nothing is timed")  # noqa: E731
    found = search_operating_point(None, None, SERVED_DIFFUSION, requests, reference, None, config, untimed)
    (paired,) = found.point["candidates"]
    for name, other in (("ar_rl", TEACHER), (PRERANK, PRE)):
        key = paired_key(name)
        low, high = _expected(MODEL, other, config.n_boot, 0)
        assert paired[f"{key}.n"] == 180
        assert (paired[f"{key}.low"], paired[f"{key}.high"]) == (
            pytest.approx(low, abs=1e-12),
            pytest.approx(high, abs=1e-12),
        )
    assert found.point["level"] == 0.95 and "(95% paired bootstrap" in found.point["rule"]


def test_the_comparisons_intervals_are_95_percent() -> None:
    """`comparisons.json` through its node, conf/base's evaluation settings and policy."""
    params = load_parameters(conf_source=CONF)
    evaluation = params["evaluation"] | {"compare_metrics": ["recall@1"]}
    rankings = pd.concat([_rows(MODEL, "rl", 0.9), _rows(TEACHER, "ar_rl", None)], ignore_index=True)
    (row,) = [
        r for r in compare_to_baselines(rankings, evaluation, params["policy"]) if r["baseline"] == "ar_rl"
    ]
    low, high = _expected(MODEL, TEACHER, evaluation["n_boot"], evaluation["seed"])
    assert (row["low"], row["high"]) == (pytest.approx(low, abs=1e-12), pytest.approx(high, abs=1e-12))
