"""How often the gate's R@1 check passes a challenger at parity and refuses a clearly worse one.

The check (`core/registry/gate.decide`): the lower bound of the paired bootstrap interval of the
challenger's R@1 minus the other system's, on the gate's requests, must be >= -margin. Whether that
means anything depends on the slice size n, the margin and how often two systems disagree on a
request (the discordance d: one hits at rank 1, the other not). This script simulates paired hits
with the accuracy and discordance measured on a run's test rankings (rl vs ar_rl by default) and
prints, per (n, margin), the pass rate of a challenger at parity and of one `--worse` points below.

    .venv/bin/python benchmarks/gate_power.py [--rankings data/07_model_output/rankings.parquet]

Requests are drawn independently (the gate resamples users; a user's requests being alike widens
the real interval a little, so read the rates as slightly optimistic).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pandas as pd

from diffusion_gr2.core.evaluate.metrics import paired_bootstrap
from diffusion_gr2.core.evaluate.policy import Policy

LEVEL = Policy().level  # the gate's interval level (conf/base's `policy.level`, tests/test_config.py)


def measured(rankings: Path, a: str, b: str) -> tuple[float, float]:
    """(R@1 of b, discordance of a vs b) on the test split of a run's rankings (every tau of a pooled)."""
    rows = pd.read_parquet(rankings)
    rows = rows[rows["split"] == "test"]
    hit = [float(len(r) > 0 and r[0] == t) for r, t in zip(rows["ranking"], rows["target"], strict=True)]
    rows = rows.assign(hit=hit)
    ref = rows[rows["system"] == b].set_index(["user_id", "point"])["hit"]
    other = rows[rows["system"] == a].groupby(["user_id", "point"])["hit"].first()
    both = pd.concat([other, ref], axis=1, keys=["a", "b"]).dropna()
    return float(both["b"].mean()), float((both["a"] != both["b"]).mean())


def simulate(
    n: int, p: float, d: float, delta: float, margin: float, sims: int, n_boot: int, seed: int
) -> float:
    """Share of `sims` slices of n paired requests whose interval's lower bound clears -margin.

    Cells of one request: both hit (p11), only the challenger (p10), only the other (p01), neither.
    The challenger's R@1 is p + delta, the other's p, and they disagree on a share d of requests.
    """
    p10, p01 = d / 2 + delta / 2, d / 2 - delta / 2
    p11 = p - p01
    cells = np.array([p11, p10, p01, 1.0 - p11 - p10 - p01])
    if (cells < 0).any():
        raise ValueError(f"no paired distribution has R@1 {p}, difference {delta} and discordance {d}")
    rng = np.random.default_rng(seed)
    passed = 0
    for k in range(sims):
        draw = rng.choice(4, size=n, p=cells)
        a = np.isin(draw, (0, 1)).astype(float)
        b = np.isin(draw, (0, 2)).astype(float)
        passed += paired_bootstrap(a, b, n_boot=n_boot, seed=k, level=LEVEL).low >= -margin
    return passed / sims


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rankings", type=Path, default=Path("data/07_model_output/rankings.parquet"))
    parser.add_argument("--challenger", default="rl")
    parser.add_argument("--reference", default="ar_rl")
    parser.add_argument("--recall", type=float, help="R@1 of the reference (instead of --rankings)")
    parser.add_argument("--discordance", type=float, help="share of requests the two disagree on")
    parser.add_argument("--sizes", type=int, nargs="+", default=[128, 320, 640, 1267])
    parser.add_argument("--margins", type=float, nargs="+", default=[0.02, 0.03, 0.05, 0.07])
    parser.add_argument("--worse", type=float, default=0.08, help="R@1 points below: 'clearly worse'")
    parser.add_argument("--sims", type=int, default=300)
    parser.add_argument("--n-boot", type=int, default=500)
    args = parser.parse_args()
    if args.recall is None or args.discordance is None:
        p, d = measured(args.rankings, args.challenger, args.reference)
        source = f"{args.rankings}: {args.challenger} vs {args.reference} on test"
    else:
        p, d, source = args.recall, args.discordance, "given"
    print(f"R@1 {p:.3f}, discordance {d:.3f} ({source}); {args.sims} slices each, {args.n_boot} resamples")
    print()
    print(f"| n | margin | pass at parity | pass {args.worse:.2f} worse |")
    print("|---|---|---|---|")
    for n in args.sizes:
        for margin in args.margins:
            fair = simulate(n, p, d, 0.0, margin, args.sims, args.n_boot, 0)
            worse = simulate(n, p, d, -args.worse, margin, args.sims, args.n_boot, 1)
            print(f"| {n} | {margin:.2f} | {fair:.2f} | {worse:.2f} |")


if __name__ == "__main__":
    main()
