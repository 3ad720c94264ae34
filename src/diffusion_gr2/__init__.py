"""Diffusion-GR2: a block-diffusion generative reasoning re-ranker, as a Kedro pipeline."""

from diffusion_gr2 import moved_modules
from diffusion_gr2.core.env import quiet_offline_environment

quiet_offline_environment()
moved_modules.install()  # versions registered under older module paths still load

__version__ = "0.1.0"
