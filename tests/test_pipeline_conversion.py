"""End-to-end: the conversion pipeline through a Kedro session checks the model it really returns."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from diffusion_gr2.core.model.diffusion import as_block_diffusion
from diffusion_gr2.core.model.factory import load_model, save_model
from diffusion_gr2.parameters import file_parameters
from diffusion_gr2.pipelines.conversion import nodes
from tests.conftest import isolated_project, run_kedro
from tests.core.model.tiny import tiny_model_for
from tests.core.rank.world import make_world


@pytest.fixture(scope="module")
def conversion_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, PreTrainedModel]]:
    """A tiny AR teacher where the catalog keeps `model_ar_rl`, converted by `kedro run`."""
    with isolated_project(tmp_path_factory.mktemp("conversion_project")) as root:
        tokenizer, _ = make_world()
        tokenizer.save_pretrained(root / "data/06_models/tokenizer")
        teacher = tiny_model_for(tokenizer).cpu()
        save_model(teacher, tokenizer, root / "data/06_models/ar_rl")
        run_kedro(root, ["conversion"])
        yield root, teacher


def test_converted_model_on_disk_is_the_teacher_with_block_size_and_mask(
    conversion_run: tuple[Path, PreTrainedModel],
) -> None:
    root, teacher = conversion_run
    params = file_parameters(root / "conf/smoke/parameters_training.yml")["conversion"]
    naive = load_model(root / "data/06_models/naive")  # rejects missing / unexpected keys
    assert naive.config.block_size == params["block_size"] > 1
    tokenizer = PreTrainedTokenizerFast.from_pretrained(root / "data/06_models/tokenizer")
    assert naive.config.mask_token_id == tokenizer.mask_token_id is not None
    ar, bd = teacher.state_dict(), naive.state_dict()
    assert ar.keys() == bd.keys() and all(torch.equal(ar[k], bd[k]) for k in ar)


def test_the_node_rejects_a_conversion_that_changes_a_weight(monkeypatch: pytest.MonkeyPatch) -> None:
    tokenizer, _ = make_world()
    teacher = tiny_model_for(tokenizer)

    def perturbed(model: PreTrainedModel, block_size: int, mask_token_id: int | None) -> PreTrainedModel:
        converted = as_block_diffusion(model, block_size, mask_token_id)
        with torch.no_grad():
            converted.model.norm.weight.mul_(1.01)
        return converted

    nodes.convert_teacher(teacher, tokenizer, {"block_size": 4})  # the real conversion passes
    monkeypatch.setattr(nodes, "as_block_diffusion", perturbed)
    with pytest.raises(ValueError, match="model.norm.weight"):
        nodes.convert_teacher(teacher, tokenizer, {"block_size": 4})
