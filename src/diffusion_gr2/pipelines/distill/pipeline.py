"""distill: rl → distilled, in three rounds of trajectory distillation (expert iteration on the diffusion
model). Each round decodes training requests with the model it starts from, keeps the valid answers
and trains that model on the canvases those decodes ran; the second round starts from the first
round's model, so it learns from answers a model that already commits more per forward wrote.
Round k's settings are `distill` (k = 1) or `distill_round<k>`; the last round writes `distilled`.

Recording decodes once, on rank 0 (its rows, kept or set aside with their reason, are a dataset);
training runs on every process of a launch, as the other training stages do.
"""

from kedro.pipeline import Node, Pipeline

from diffusion_gr2.pipelines.training import record_trajectories_node
from diffusion_gr2.runner import ALL_RANKS

from .nodes import train_distilled

ROUNDS = 3  # three rounds of 140 steps against two of 200 (docs/experiments.md#three-rounds-of-distillation)


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
