"""distill: rl → distilled, in three rounds of trajectory distillation (expert iteration on the diffusion
model; `core/train/trajectory.py`, docs/architecture.md#pipelines-and-their-data).

Each round decodes 1,024 sampled training requests (`trajectories.requests`) with the model it starts
from, with inference's decoding settings (`inference.decoding`: commit rule, SID threshold, repeat
gate) but free, without the answer grammar, at `trajectories.tau` (0.75). It keeps an answer when the
model wrote it valid on its own, it ranks the target within `max_target_rank` (10: any valid answer,
under `keep: any`) and its explanation cites only SIDs the prompt shows (`grounded`); every row, kept
or set aside with its reason, is the round's trajectories dataset. The model is then trained on the
canvases its kept decodes ran (CFT's loss with the decode's own tokens as targets, `noise:
trajectory`) plus the certainty term (`certainty`). Round 1 starts from `rl`, each later round from
the one before, so it learns from answers a model that already commits more per forward wrote. Round
k's settings are `distill` (k = 1) or `distill_round<k>` (the first round's, by YAML merge); the last
round writes `distilled`, the diffusion system the registry holds and serving serves.

Recording decodes once, on rank 0 (its rows are a dataset); training runs on every process of a
launch, as the other training stages do.
"""

from kedro.pipeline import Node, Pipeline

from diffusion_gr2.pipelines.training import record_trajectories_node
from diffusion_gr2.runner import ALL_RANKS

from .nodes import train_distilled

# Three rounds (of `train.max_steps` 200 each) commit more per forward than two at the same own validity
# and R@1 (docs/experiments.md#three-rounds-of-distillation, #longer-distillation-rounds).
ROUNDS = 3


def round_names(k: int, rounds: int = ROUNDS) -> dict[str, str]:
    """Round k's (1-based) parameters, node-name suffix, the model it starts from, its trajectories,
    its model and its summary: round 1 starts from `rl`, each later round from the one before."""
    suffix = "" if k == 1 else f"_round{k}"
    return {
        "params": f"distill{suffix}",
        "suffix": suffix,
        "init": "model_rl" if k == 1 else f"model_distill_round{k - 1}",
        "trajectories": f"trajectories{suffix}",
        "model": "model_distilled" if k == rounds else f"model_distill_round{k}",
        "summary": f"distill{suffix}_summary",
    }


def create_pipeline(**kwargs) -> Pipeline:
    nodes = []
    for k in range(1, ROUNDS + 1):
        r = round_names(k)
        nodes += [
            Node(
                record_trajectories_node,
                [r["init"], "requests", "tokenizer", f"params:{r['params']}", "params:inference"],
                r["trajectories"],
                name=f"record_trajectories{r['suffix']}",
            ),
            Node(
                train_distilled,
                [r["init"], r["trajectories"], "tokenizer", f"params:{r['params']}"],
                [r["model"], r["summary"]],
                name=f"train_distilled{r['suffix']}",
                tags=ALL_RANKS,
            ),
        ]
    return Pipeline(nodes)
