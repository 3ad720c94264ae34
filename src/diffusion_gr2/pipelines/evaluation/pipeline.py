"""evaluation: rankings → stage metrics, comparisons with the baselines, table and plots."""

from kedro.pipeline import Node, Pipeline

from .nodes import compare_to_baselines, compute_stage_metrics, log_eval_metrics, plot_stage_metrics


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
                inputs=["rankings", "params:evaluation"],
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
        ]
    )
