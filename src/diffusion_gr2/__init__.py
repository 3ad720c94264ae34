"""Diffusion-GR2: a block-diffusion generative reasoning re-ranker, as a Kedro pipeline."""

from diffusion_gr2.core.env import quiet_offline_environment

quiet_offline_environment()

__version__ = "0.1.0"
