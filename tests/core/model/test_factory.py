"""Model factory, atomic save/load, and AR -> block-diffusion conversion."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from diffusion_gr2.core.model.diffusion import (
    as_block_diffusion,
    check_conversion,
    convert_to_block_diffusion,
)
from diffusion_gr2.core.model.factory import ModelSpec, build_model, load_model, save_model
from tests.core.model.tiny import tiny_tokenizer

SMALL = ModelSpec(
    hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64
)


def test_config_model_takes_the_tokenizer_vocab_and_is_seeded() -> None:
    tok = tiny_tokenizer(40)
    before = torch.random.get_rng_state()
    model = build_model(SMALL, tok)
    assert torch.equal(torch.random.get_rng_state(), before)  # the caller's RNG is untouched
    assert model.config.vocab_size == 40 and model.get_input_embeddings().num_embeddings == 40
    assert model.config.pad_token_id == tok.pad_token_id and model.config.eos_token_id == tok.eos_token_id
    assert model.config._attn_implementation == "sdpa" and model.config.tie_word_embeddings
    again = build_model(SMALL, tok)
    assert all(
        torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), again.state_dict().values(), strict=True)
    )


def test_default_spec_is_the_documented_size() -> None:
    model = build_model(ModelSpec(), tiny_tokenizer())
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        128,
        4,
        4,
        2,
    )
    assert (cfg.head_dim, cfg.intermediate_size, cfg.max_position_embeddings) == (32, 384, 1024)


def test_save_load_round_trip_and_pretrained_resize(tmp_path: Path) -> None:
    tok = tiny_tokenizer(40)
    model = build_model(SMALL, tok)
    out = save_model(model, tok, tmp_path / "m")
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dir left behind
    loaded = load_model(out)
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)
    bigger = build_model(ModelSpec(kind="pretrained", path=str(out)), tiny_tokenizer(50))  # tokens were added
    assert bigger.get_input_embeddings().num_embeddings == 50
    assert torch.equal(bigger.get_input_embeddings().weight[:40], model.get_input_embeddings().weight)


@pytest.mark.parametrize(
    ("edit", "fault"),
    [
        (lambda w: w.pop("model.norm.weight"), "missing_keys"),
        (lambda w: w.update({"model.extra.weight": torch.zeros(2)}), "unexpected_keys"),
    ],
)
def test_load_rejects_missing_and_unexpected_weights(tmp_path: Path, edit, fault: str) -> None:
    out = save_model(build_model(SMALL, tiny_tokenizer(40)), None, tmp_path / "m")
    weights = load_file(out / "model.safetensors")
    edit(weights)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=fault):
        load_model(out)


def test_bad_specs_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown model kind"):
        build_model(ModelSpec(kind="onnx"), tiny_tokenizer())
    with pytest.raises(ValueError, match="needs a path"):
        build_model(ModelSpec(kind="pretrained"), tiny_tokenizer())


def test_conversion_copies_weights_and_records_block_size(tmp_path: Path) -> None:
    tok = tiny_tokenizer(40)
    ar = build_model(SMALL, tok)
    save_model(ar, tok, tmp_path / "ar")
    out = convert_to_block_diffusion(tmp_path / "ar", tmp_path / "bd", 8, tok)
    bd = load_model(out)
    assert bd.config.block_size == 8 and bd.config.mask_token_id == tok.mask_token_id
    ar_sd, bd_sd = ar.state_dict(), bd.state_dict()
    assert ar_sd.keys() == bd_sd.keys()
    assert all(torch.equal(ar_sd[k], bd_sd[k]) for k in ar_sd)


def test_conversion_check_rejects_a_changed_weight_or_config() -> None:
    tok = tiny_tokenizer(40)
    ar = build_model(SMALL, tok)
    converted = as_block_diffusion(ar, 8, tok.mask_token_id)
    check_conversion(ar, converted, 8, tok.mask_token_id)
    with pytest.raises(ValueError, match="expected"):
        check_conversion(ar, converted, 4, tok.mask_token_id)  # B not what the config records
    with pytest.raises(ValueError, match="new model"):
        check_conversion(ar, ar, 8, tok.mask_token_id)
    with torch.no_grad():
        converted.model.norm.weight[0] += 1e-3
    with pytest.raises(ValueError, match=r"changed \['model.norm.weight'\]"):
        check_conversion(ar, converted, 8, tok.mask_token_id)


def test_conversion_needs_the_mask_token_in_the_vocab(tmp_path: Path) -> None:
    tok = tiny_tokenizer(40)
    save_model(build_model(SMALL, tok), tok, tmp_path / "ar")
    no_mask = tiny_tokenizer(40)
    no_mask.mask_token = None
    with pytest.raises(ValueError, match="mask token"):
        convert_to_block_diffusion(tmp_path / "ar", tmp_path / "bd", 4, no_mask)
    assert not (tmp_path / "bd").exists()


def test_one_writer_serves_the_stages_and_the_catalog(tmp_path: Path) -> None:
    """`save_model` writes the stages' folders and the catalog's (`PretrainedDataset`, the tokenizer
    copied from its own folder): the same files, byte for byte."""
    from diffusion_gr2.datasets import PretrainedDataset

    tok = tiny_tokenizer(40)
    model = build_model(SMALL, tok)
    save_model(model, tok, tmp_path / "stage")
    PretrainedDataset(str(tmp_path / "tokenizer"), kind="tokenizer", log_to_mlflow=False).save(tok)
    catalog = PretrainedDataset(
        str(tmp_path / "model"), tokenizer_path=str(tmp_path / "tokenizer"), log_to_mlflow=False
    )
    catalog.save(model)
    stage = sorted(p.name for p in (tmp_path / "stage").iterdir())
    assert stage == sorted(p.name for p in (tmp_path / "model").iterdir())
    assert all((tmp_path / "stage" / n).read_bytes() == (tmp_path / "model" / n).read_bytes() for n in stage)
    assert sorted(p.name for p in (tmp_path / "tokenizer").iterdir()) == [
        "tokenizer.json",
        "tokenizer_config.json",
    ]


def test_a_failed_write_leaves_the_previous_folder_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tok = tiny_tokenizer(40)
    model = build_model(SMALL, tok)
    before = {p.name: p.read_bytes() for p in save_model(model, tok, tmp_path / "m").iterdir()}

    def disk_full(self: object, directory: Path, **kwargs: object) -> None:  # after the weights
        raise OSError("disk full")

    monkeypatch.setattr(type(tok), "save_pretrained", disk_full)
    with pytest.raises(OSError, match="disk full"):
        save_model(model, tok, tmp_path / "m")
    assert {p.name: p.read_bytes() for p in (tmp_path / "m").iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # no temp folder left behind
    with pytest.raises(OSError):
        save_model(model, tok, tmp_path / "new")
    assert not (tmp_path / "new").exists()
