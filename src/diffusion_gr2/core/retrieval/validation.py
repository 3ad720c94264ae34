"""Checks for the `candidates` frame: a pandera schema and a Great Expectations suite
(docs/architecture.md#data).

GX has no reliable expectations on list cells under pandas 2.3 object columns, so the suite runs on a
scalar view of the frame (`candidate_check_frame`): one row per list with its length, duplicate count,
foreign-ID count, whether the target sits where `target_position` says, and the leakage facts of
`history_facts` (history length, target or other candidates inside the history, repeated rows), which
the pandera schema checks too.

Leakage rules: a candidate other than the target is never in the history (the retriever masks it,
sampled negatives avoid it). The target is not in the history either, and the target of a validation
or test row is nowhere in the user's train rows (history or target: what traces, SFT and RL are built
from), unless the data was prepared without dedup (``allow_repeats``), where consuming an item again
is a legitimate target.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pandera.pandas as pa

from diffusion_gr2.core.data.expectations import ExpectationReport, run_expectations
from diffusion_gr2.core.data.schemas import validate
from diffusion_gr2.core.retrieval.candidates import SPLITS


def _ids(value: Any) -> list[int] | None:
    """A list cell (list or numpy array from parquet) as ints; None if it is not a list of integers."""
    if not isinstance(value, list | tuple | np.ndarray):
        return None
    if not all(isinstance(v, int | np.integer) and not isinstance(v, bool) for v in value):
        return None
    return [int(v) for v in value]


def _id_list_check(num_items: int, length: int | None, unique: bool, name: str) -> pa.Check:
    def check(value: Any) -> bool:
        ids = _ids(value)
        return (
            ids is not None
            and (length is None or len(ids) == length)
            and (not unique or len(set(ids)) == len(ids))
            and all(0 <= v < num_items for v in ids)
        )

    return pa.Check(check, element_wise=True, name=name)


def _position_matches(df: pd.DataFrame) -> pd.Series:
    """target_position p > 0 means candidates[p-1] == target; p == 0 means the target is absent."""
    return pd.Series([_position_ok(c, t, p) for c, t, p in _triples(df)], index=df.index)


def _triples(df: pd.DataFrame) -> zip:
    return zip(df["candidates"], df["target"], df["target_position"], strict=True)


def _position_ok(candidates: Any, target: int, position: int) -> bool:
    ids = _ids(candidates) or []
    if position == 0:
        return int(target) not in ids
    return 0 < position <= len(ids) and ids[position - 1] == int(target)


def _row_key(user: int, split: str, point: int, target: int, history: list[int]) -> str:
    """What makes a row unique: one valid/test row per (user, point); train rows are distinct prefixes."""
    if split == "train":
        return f"train/{user}/{target}/{','.join(map(str, history))}"
    return f"{split}/{user}/{point}"


def _trained_on(frame: pd.DataFrame, histories: list[set[int]], targets: list[int]) -> list[bool]:
    """Per row: a held-out (validation/test) target that is in one of its user's train rows."""
    seen: dict[int, set[int]] = {}
    for user, split, history, target in zip(
        frame["user_id"], frame["split"], histories, targets, strict=True
    ):
        if split == "train":
            seen.setdefault(int(user), set()).update(history, [target])
    return [
        s != "train" and t in seen.get(int(u), set())
        for u, s, t in zip(frame["user_id"], frame["split"], targets, strict=True)
    ]


def history_facts(frame: pd.DataFrame) -> pd.DataFrame:
    """Per row: ``n_history``, ``target_in_history``, ``n_candidates_in_history`` (the target aside),
    ``target_trained_on`` (`_trained_on`) and ``repeated_row`` (a second row for the same split, user
    and point, or the same train prefix)."""
    histories = [set(_ids(h) or []) for h in frame["history"]]
    lists = [_ids(c) or [] for c in frame["candidates"]]
    targets = [int(t) for t in frame["target"]]
    keys = [
        _row_key(int(u), str(s), int(p), t, _ids(h) or [])
        for u, s, p, t, h in zip(
            frame["user_id"], frame["split"], frame["point"], targets, frame["history"], strict=True
        )
    ]
    return pd.DataFrame(
        {
            "n_history": [len(_ids(h) or []) for h in frame["history"]],
            "target_in_history": [t in h for t, h in zip(targets, histories, strict=True)],
            "n_candidates_in_history": [
                sum(c in h and c != t for c in cands)
                for cands, h, t in zip(lists, histories, targets, strict=True)
            ],
            "target_trained_on": _trained_on(frame, histories, targets),
            "repeated_row": pd.Series(keys).duplicated(keep="first").to_numpy(),
        },
        index=frame.index,
    )


def _leakage_checks(allow_repeats: bool) -> list[pa.Check]:
    """Frame-level pandera checks built on `history_facts` (one boolean per row)."""

    def fact(test: Any, name: str) -> pa.Check:
        return pa.Check(lambda df: test(history_facts(df)), name=name)

    checks = [
        fact(lambda f: f["n_candidates_in_history"] == 0, "no_candidate_in_history"),
        fact(lambda f: ~f["repeated_row"], "one_row_per_request"),
    ]
    if not allow_repeats:
        checks.append(fact(lambda f: ~f["target_in_history"], "target_not_in_history"))
        checks.append(fact(lambda f: ~f["target_trained_on"], "held_out_target_not_in_train_rows"))
    return checks


def candidates_schema(
    n: int, num_items: int, require_target: bool = True, allow_repeats: bool = False
) -> pa.DataFrameSchema:
    """Pandera schema of the candidates frame for lists of length n over a catalog of num_items.

    ``allow_repeats`` (data prepared without dedup) lets the target appear in the history.
    """
    return pa.DataFrameSchema(
        {
            "user_id": pa.Column("int64", pa.Check.ge(0)),
            "split": pa.Column(str, pa.Check.isin(SPLITS)),
            "point": pa.Column("int64", pa.Check.ge(0)),
            "history": pa.Column(
                object,
                [
                    _id_list_check(num_items, None, False, "history_ids_in_catalog"),
                    pa.Check(lambda h: len(_ids(h) or []) > 0, element_wise=True, name="history_not_empty"),
                ],
            ),
            "target": pa.Column("int64", pa.Check.in_range(0, num_items - 1)),
            "candidates": pa.Column(object, _id_list_check(num_items, n, True, f"{n}_unique_ids_in_catalog")),
            "target_position": pa.Column("int64", pa.Check.in_range(1 if require_target else 0, n)),
        },
        checks=[
            pa.Check(_position_matches, name="target_position_matches_list"),
            *_leakage_checks(allow_repeats),
        ],
        strict=True,
        name="candidates",
    )


def validate_candidates(
    frame: pd.DataFrame, n: int, num_items: int, require_target: bool = True, allow_repeats: bool = False
) -> pd.DataFrame:
    """Validate with `candidates_schema`; raises `SchemaValidationError` naming columns, checks and rows."""
    return validate(frame, candidates_schema(n, num_items, require_target, allow_repeats), "candidates")


def candidate_check_frame(frame: pd.DataFrame, num_items: int) -> pd.DataFrame:
    """Scalar view for GX, indexed "row:split/user/point" so a failure names the list it came from."""
    lists = [_ids(c) or [] for c in frame["candidates"]]
    histories = [_ids(h) or [] for h in frame["history"]]
    targets = frame["target"].to_numpy(dtype=np.int64)
    check = pd.DataFrame(
        {
            "user_id": frame["user_id"].to_numpy(),
            "split": frame["split"].to_numpy(),
            "point": frame["point"].to_numpy(),
            "target": targets,
            "target_position": frame["target_position"].to_numpy(),
            "n_candidates": [len(c) for c in lists],
            "n_duplicates": [len(c) - len(set(c)) for c in lists],
            "n_foreign": [sum(not 0 <= v < num_items for v in c) for c in lists],
            "n_history_foreign": [sum(not 0 <= v < num_items for v in h) for h in histories],
            "target_in_list": [int(t) in c for t, c in zip(targets, lists, strict=True)],
            "position_matches": _position_matches(frame).to_numpy(),
            **{k: v.to_numpy() for k, v in history_facts(frame).items()},
        }
    )
    where = zip(check["split"], check["user_id"], check["point"], strict=True)
    labels = [f"{i}:{s}/{u}/{p}" for i, (s, u, p) in enumerate(where)]
    return check.set_index(pd.Index(labels, name="row"))


def candidate_suite(
    n: int, num_items: int, require_target: bool = True, allow_repeats: bool = False
) -> list[Any]:
    """GX expectations on `candidate_check_frame`: list length n, unique IDs, IDs in [0, num_items),
    target present where required, target_position in 1..n (0..n when not required) and consistent,
    a non-empty history with no candidate leaked into it, no held-out target in the user's train rows,
    one row per request (split, user, point)."""
    import great_expectations.expectations as gxe

    zero = {"min_value": 0, "max_value": 0}
    suite: list[Any] = [
        gxe.ExpectTableRowCountToBeBetween(min_value=1),
        gxe.ExpectColumnValuesToNotBeNull(column="user_id"),
        gxe.ExpectColumnValuesToBeInSet(column="split", value_set=list(SPLITS)),
        gxe.ExpectColumnValuesToBeBetween(column="n_candidates", min_value=n, max_value=n),
        gxe.ExpectColumnValuesToBeBetween(column="n_duplicates", **zero),
        gxe.ExpectColumnValuesToBeBetween(column="n_foreign", **zero),
        gxe.ExpectColumnValuesToBeBetween(column="n_history_foreign", **zero),
        gxe.ExpectColumnValuesToBeBetween(column="target", min_value=0, max_value=num_items - 1),
        gxe.ExpectColumnValuesToBeBetween(
            column="target_position", min_value=1 if require_target else 0, max_value=n
        ),
        gxe.ExpectColumnValuesToBeInSet(column="position_matches", value_set=[True]),
        gxe.ExpectColumnValuesToBeBetween(column="n_history", min_value=1),
        gxe.ExpectColumnValuesToBeBetween(column="n_candidates_in_history", **zero),
        gxe.ExpectColumnValuesToBeInSet(column="repeated_row", value_set=[False]),
    ]
    if require_target:
        suite.append(gxe.ExpectColumnValuesToBeInSet(column="target_in_list", value_set=[True]))
    if not allow_repeats:
        suite.append(gxe.ExpectColumnValuesToBeInSet(column="target_in_history", value_set=[False]))
        suite.append(gxe.ExpectColumnValuesToBeInSet(column="target_trained_on", value_set=[False]))
    return suite


def check_candidates(
    frame: pd.DataFrame,
    n: int,
    num_items: int,
    require_target: bool = True,
    report_dir: Path | str | None = None,
    suite_name: str = "candidates",
    allow_repeats: bool = False,
) -> ExpectationReport:
    """Run `candidate_suite` through the shared GX runner; saves `<suite_name>.json` under report_dir."""
    return run_expectations(
        candidate_check_frame(frame, num_items),
        suite_name,
        candidate_suite(n, num_items, require_target, allow_repeats),
        report_dir,
    )
