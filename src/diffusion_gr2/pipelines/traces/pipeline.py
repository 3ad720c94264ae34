"""traces: candidate lists → teacher traces → tokenizer → token-level SFT examples and requests."""

from kedro.pipeline import Node, Pipeline

from .nodes import encode_datasets, generate_traces, train_tokenizer


def create_pipeline(**kwargs) -> Pipeline:
    return Pipeline(
        [
            Node(
                generate_traces,
                inputs=["candidates", "items", "sids", "splits", "params:traces", "params:policy"],
                outputs=["traces", "trace_stats", "evidence"],
                name="generate_traces",
            ),
            Node(
                train_tokenizer,
                inputs=["traces", "sids", "params:traces", "params:teacher_sft.model"],
                outputs="tokenizer",
                name="train_tokenizer",
            ),
            Node(
                encode_datasets,
                inputs=[
                    "traces",
                    "candidates",
                    "items",
                    "sids",
                    "tokenizer",
                    "trace_stats",
                    "evidence",
                    "splits",
                    "params:traces",
                ],
                outputs=["sft_examples", "requests", "trace_report", "trace_metrics"],
                name="encode_datasets",
            ),
        ]
    )
