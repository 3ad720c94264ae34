"""benchmark: decode speed of `ar_rl`, `generate` and the diffusion systems, same machine, one run."""

from __future__ import annotations

from collections.abc import Sequence

from kedro.pipeline import Node, Pipeline

from diffusion_gr2.pipelines.evaluation.pipeline import report_node

from .nodes import benchmark_decoding

# The AR reference and the diffusion systems whose speed the paper reports (naive is not worth timing).
BENCHMARK_SYSTEMS = ("ar_rl", "cft", "opd", "rl", "distilled")


def create_pipeline(systems: Sequence[str] = BENCHMARK_SYSTEMS, **kwargs) -> Pipeline:
    models = {system: f"model_{system}" for system in systems}
    return Pipeline(
        [
            Node(
                benchmark_decoding,
                inputs={
                    "requests": "requests",
                    "tokenizer": "tokenizer",
                    "operating_point": "operating_point",  # written by `inference` (chosen on validation)
                    "params": "params:benchmark",
                    **models,
                },
                outputs={
                    "benchmark": "benchmark",
                    "speedup_by_length": "speedup_by_length",
                    "benchmark_metrics": "benchmark_metrics",
                    "batch_plot": "benchmark_plot_batch",
                    "length_plot": "benchmark_plot_length",
                },
                name="benchmark_decoding",
            ),
            # The run report again, now with the benchmark table and the batch-size and length plots.
            report_node(
                "write_report_with_benchmark", benchmark="benchmark", speedup_by_length="speedup_by_length"
            ),
        ]
    )
