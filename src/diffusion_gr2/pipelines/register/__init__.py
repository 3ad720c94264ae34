"""register pipeline: the trained `distilled` (with an operating point) and `ar_rl` into the registry,
gated, the pre-rank as the fallback (`make register` after a run; docs/operations.md#registry).

Its own folder because Kedro loads only the pipelines a run asks for, by folder name.
"""

from diffusion_gr2.pipelines.retrain import registration_pipeline


def create_pipeline(**kwargs):  # noqa: ANN201 (Kedro's entry point)
    return registration_pipeline()


__all__ = ["create_pipeline"]
