"""The project's Kedro pipelines, one folder per stage (docs/architecture.md#names-and-report-files)."""

# `__default__` runs these in order; the training stages are what a retrain reruns (inference and
# evaluation are not needed to gate).
DEFAULT_STAGES = (
    "data_prep",
    "semantic_ids",
    "retrieval",
    "traces",
    "teacher",
    "conversion",
    "cft",
    "opd",
    "rl",
    "distill",
    "inference",
    "evaluation",
)
TRAINING_STAGES = DEFAULT_STAGES[: DEFAULT_STAGES.index("distill") + 1]
