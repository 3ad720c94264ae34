"""evaluation: rankings → stage metrics, comparisons with the baselines, reasoning quality, table, plots
and the run report."""

from kedro.pipeline import Node, Pipeline

from .nodes import (
    compare_to_baselines,
    compute_reasoning_metrics,
    compute_stage_metrics,
    log_eval_metrics,
    plot_stage_metrics,
    write_report,
)

# The report's other inputs; the `report_*` ones are optional (None while absent: `OptionalJSONDataset`).
REPORT_FILES = {
    "operating_point": "operating_point",
    "data_stats": "report_data_stats",
    "sid_report": "report_sid_report",
    "retrieval_report": "report_retrieval_report",
    "benchmark": "report_benchmark",
    "speedup_by_length": "report_speedup_by_length",
    "decode_profile": "report_decode_profile",
    "runs": "report_runs",  # the manifests of the files above: which run each figure came from
}
REPORT_OUTPUTS = {
    "report_md": "report_md",
    "report_html": "report_html",
    "frontier_plot": "eval_plot_frontier",
    "own_valid_plot": "eval_plot_own_valid_rate",
    "training_plot": "eval_plot_training_curves",
}


def report_node(name: str = "write_report", **files: str) -> Node:
    """The report node; `files` replaces some of `REPORT_FILES` (the benchmark passes its fresh rows)."""
    return Node(
        write_report,
        inputs={
            "stage_rows": "stage_metrics",
            "comparisons": "comparisons",
            "reasoning": "reasoning_metrics",
            "rankings": "rankings",
            "params": "params:evaluation",
            **(REPORT_FILES | files),
        },
        outputs=REPORT_OUTPUTS,
        name=name,
    )


def create_pipeline(**kwargs) -> Pipeline:
    return Pipeline(
        [
            Node(
                compute_stage_metrics,
                inputs=["rankings", "params:evaluation"],
                outputs={"stage_metrics": "stage_metrics", "stage_metrics_md": "stage_metrics_md"},
                name="compute_stage_metrics",
            ),
            Node(
                compare_to_baselines,
                inputs=["rankings", "params:evaluation", "params:policy"],
                outputs="comparisons",
                name="compare_to_baselines",
            ),
            Node(
                log_eval_metrics,
                inputs=["stage_metrics", "comparisons"],
                outputs="eval_metrics",
                name="log_eval_metrics",
            ),
            Node(
                plot_stage_metrics,
                inputs="stage_metrics",
                outputs={"recall_plot": "eval_plot_recall_at_1", "valid_rate_plot": "eval_plot_valid_rate"},
                name="plot_stage_metrics",
            ),
            Node(
                compute_reasoning_metrics,
                inputs=["rankings", "requests", "tokenizer", "params:evaluation"],
                outputs={
                    "reasoning_metrics": "reasoning_metrics",
                    "reasoning_mlflow": "reasoning_mlflow_metrics",
                },
                name="compute_reasoning_metrics",
            ),
            report_node(),
        ]
    )
