"""How much the prompt says beyond the retriever's order: R@1 of a feature ranker against the pre-rank.

    .venv/bin/python benchmarks/feature_ceiling.py [--c 0.1 1 10] [--w-position 0.5 1.5 2.5 3.5]

Fits a logistic ranker on the training requests. Each candidate's input is the rule-based teacher's
features (`core/text/traces.py`: category overlap, brand, recency, popularity, position) plus a one-hot
of its retriever position. The ranker then puts each request's highest-scoring candidate first, on
every split. Where this ranker barely beats the pre-rank, the prompts carry little signal beyond the
retriever, and a re-ranker trained from scratch on them cannot be expected to beat it either: only a
model with knowledge of its own (a pretrained checkpoint) can. Reads the outputs of `make run` (data/).

It also scores the rule-based teacher itself, without noise, at each `--w-position` (the weight of the
retriever's order): its R@1, how often its top pick differs from the retriever's, how often such a
change is right, and how often the demoted item was (choose on `train`, the requests the traces
come from; `valid` is small).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pandas as pd
from sklearn.linear_model import LogisticRegression

from diffusion_gr2.core.text.prompt import ItemLookup, PromptConfig
from diffusion_gr2.core.text.traces import (
    AnalystConfig,
    RuleBasedAnalyst,
    examples_from_frame,
    popularity_from_histories,
)
from diffusion_gr2.parameters import file_parameters

ROOT = Path(__file__).resolve().parents[1]


def split_features(
    analyst: RuleBasedAnalyst, candidates: pd.DataFrame, split: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """Candidate rows (features + one-hot position), is-target labels, request index, pre-rank R@1."""
    examples = [
        e for e in examples_from_frame(candidates[candidates["split"] == split]) if e.target in e.candidates
    ]
    rows, labels, groups = [], [], []
    for i, example in enumerate(examples):
        features, _ = analyst.scores(example)
        n = len(example.candidates)
        rows.append(np.hstack([features, np.eye(n)]))
        labels += [c == example.target for c in example.candidates]
        groups += [i] * n
    prerank = float(np.mean([e.candidates[0] == e.target for e in examples]))
    return np.vstack(rows), np.array(labels), np.array(groups), prerank


def teacher_line(teacher: RuleBasedAnalyst, candidates: pd.DataFrame, split: str) -> str:
    """The noiseless teacher's pick against the retriever's first item, on one split's requests."""
    examples = [
        e for e in examples_from_frame(candidates[candidates["split"] == split]) if e.target in e.candidates
    ]
    picks = [e.candidates[int(np.argmax(teacher.scores(e)[1]))] for e in examples]
    right = np.array([p == e.target for p, e in zip(picks, examples, strict=True)])
    first_right = np.array([e.candidates[0] == e.target for e in examples])
    changed = np.array([p != e.candidates[0] for p, e in zip(picks, examples, strict=True)])

    def among_changed(hit: np.ndarray) -> float:  # nan when the teacher never leaves the retriever
        return float(hit[changed].mean()) if changed.any() else float("nan")

    return (
        f"{right.mean():11.3f} {first_right.mean():8.3f} {changed.mean():7.2f} "
        f"{among_changed(right):12.3f} {among_changed(first_right):13.3f}"
    )


def recall_at_1(scores: np.ndarray, labels: np.ndarray, groups: np.ndarray) -> float:
    """Share of requests whose highest-scoring candidate is the target."""
    return float(np.mean([labels[groups == g][np.argmax(scores[groups == g])] for g in np.unique(groups)]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--c", type=float, nargs="+", default=[0.1, 1.0, 10.0], help="inverse L2 strengths")
    parser.add_argument("--w-position", type=float, nargs="*", default=[0.5, 1.5, 2.5, 3.5])
    parser.add_argument("--data", type=Path, default=ROOT / "data")
    parser.add_argument("--params", type=Path, default=ROOT / "conf/base/parameters_traces.yml")
    args = parser.parse_args()

    params = file_parameters(args.params)["traces"]
    prompt = PromptConfig(**params["prompt"])
    items = pd.read_parquet(args.data / "03_primary/items.parquet")
    sids = pd.read_parquet(args.data / "04_feature/sids.parquet")
    candidates = pd.read_parquet(args.data / "05_model_input/candidates.parquet")
    splits = pd.read_parquet(args.data / "05_model_input/splits.parquet")
    analyst = RuleBasedAnalyst(
        ItemLookup.from_frames(items, sids, prompt),
        popularity_from_histories(splits["train_items"]),  # training histories only: no leakage
        AnalystConfig(**params["analyst"]),
        prompt,
    )
    print(
        f"{'w_pos':>6s} {'split':6s} {'teacher R@1':>11s} {'pre-rank':>8s} {'changed':>7s} {'change right':>12s} {'demoted right':>13s}"
    )
    for w in args.w_position:
        teacher = RuleBasedAnalyst(
            analyst.lookup,
            analyst.popularity,
            AnalystConfig(**{**params["analyst"], "w_position": w}),
            prompt,
        )
        for split in ("train", "valid", "test"):
            print(f"{w:6g} {split:6s} " + teacher_line(teacher, candidates, split))
    data = {split: split_features(analyst, candidates, split) for split in ("train", "valid", "test")}
    x_train, y_train, _, _ = data["train"]
    print(f"{'C':>6s} {'split':6s} {'ranker R@1':>10s} {'pre-rank R@1':>12s} {'requests':>8s}")
    for c in args.c:
        ranker = LogisticRegression(C=c, max_iter=2000).fit(x_train, y_train)
        for split, (x, y, groups, prerank) in data.items():
            r1 = recall_at_1(ranker.decision_function(x), y, groups)
            print(f"{c:6g} {split:6s} {r1:10.3f} {prerank:12.3f} {len(np.unique(groups)):8d}")


if __name__ == "__main__":
    main()
