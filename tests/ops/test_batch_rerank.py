"""Batch re-ranking in one process: request files read as a stream, answered chunk by chunk, resumed
after the last published chunk, started afresh for another model or input (core/serving/batch.py).
Several processes: tests/distributed/test_batch_rerank.py."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from kedro.io import DatasetError
from transformers import PreTrainedTokenizerFast

from diffusion_gr2.core.model.factory import load_model
from diffusion_gr2.core.serving import batch
from diffusion_gr2.core.serving.batch import BatchJob, RequestFiles, job_key, summarize
from diffusion_gr2.core.serving.request_log import ServedModel
from diffusion_gr2.core.serving.serving import Ranker
from diffusion_gr2.datasets import AnswerChunksDataset, RequestFilesDataset
from tests.ops.conftest import World


@pytest.fixture(scope="module")
def ranker(world: World) -> Ranker:
    path = world.models["rl"]
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
    return Ranker(load_model(path), tokenizer, world.items, world.sids, world.config())


def _requests(world: World, n: int) -> list[dict]:
    rows = world.candidates.iloc[[i % len(world.candidates) for i in range(n)]]
    return [
        {"history": world.raw(r.history), "candidates": world.raw(r.candidates), "request_id": f"r{i}"}
        for i, r in enumerate(rows.itertuples(index=False))
    ]


def _ids(folder: Path) -> list:
    return [r.value.get("request_id") if r.value else r.error for r in RequestFiles(folder).records()]


def test_every_format_is_read_as_a_stream_in_file_and_request_order(
    world: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(batch, "_READ_BYTES", 7)  # a JSON list window far smaller than one request
    requests = _requests(world, 5)
    (tmp_path / "a.json").write_text(json.dumps(requests[:3], indent=1))
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps(r) for r in requests[3:]) + "\n\n")
    pd.DataFrame(requests[:2]).to_parquet(tmp_path / "c.parquet")
    (tmp_path / "d.json").write_text(json.dumps({"requests": requests[:1]}))
    (tmp_path / "e.json").write_text(json.dumps(requests[4]))
    (tmp_path / "notes.txt").write_text("not a request file")
    assert _ids(tmp_path) == ["r0", "r1", "r2", "r3", "r4", "r0", "r1", "r0", "r4"]
    parquet = [r for r in RequestFiles(tmp_path).records() if r.file == "c.parquet"]
    assert parquet[1].value["candidates"] == requests[1]["candidates"] and parquet[1].position == 1


def test_a_broken_file_keeps_what_precedes_the_break_and_names_it(
    world: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(batch, "_READ_BYTES", 16)
    requests = _requests(world, 3)
    text = json.dumps(requests)
    cut = text.index('{"history"', 10)  # the second request starts here
    (tmp_path / "a.json").write_text(text[:cut] + "{oops " + text[cut:])
    (tmp_path / "b.jsonl").write_text(json.dumps(requests[0]) + "\n{nope\n" + json.dumps(requests[2]) + "\n")
    (tmp_path / "c.json").write_text("[1, 2]")
    got = list(RequestFiles(tmp_path).records())
    assert got[0].value["request_id"] == "r0" and "not JSON from character" in got[1].error
    assert len([r for r in got if r.file == "a.json"]) == 2
    jsonl = [r for r in got if r.file == "b.jsonl"]
    assert [r.error for r in jsonl] == [
        None,
        "line 2: not JSON: Expecting property name enclosed in double quotes",
        None,
    ]
    assert [r.value for r in got if r.file == "c.json"] == [1, 2]  # read; refused when answered


def _job(ranker: Ranker, folder: Path, chunk_size: int = 4, digest: str = "model-a") -> BatchJob:
    files = RequestFiles(folder)
    key = job_key(digest, {"serving": ranker.config.to_json()}, files, chunk_size)
    return BatchJob(files, ranker, ServedModel(), chunk_size, key)


class Stop(Exception):
    pass


def test_a_stopped_batch_resumes_after_its_last_chunk_and_equals_an_uninterrupted_one(
    world: World, ranker: Ranker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    requests = _requests(world, 10)
    requests[6] = {**requests[6], "history": []}
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "day.json").write_text(json.dumps(requests[:7] + ["not an object"] + requests[7:]))
    whole = AnswerChunksDataset(str(tmp_path / "whole"))
    whole.save(_job(ranker, tmp_path / "in"))
    expected = pd.read_parquet(tmp_path / "whole").drop(columns="latency_ms")
    assert len(expected) == 11 and len(whole.load()) == 3  # chunks of 4, 4, 3
    refused = expected[~expected["ok"]].set_index("position")["error"]
    assert "'history' is empty" in refused[6] and "not an object" in refused[7]

    answered = []
    real_rank = ranker.rank

    def rank_then_stop(requests, *args, **kwargs):  # stopped while the second chunk decodes
        answered.append(len(requests))
        if len(answered) == 2:
            raise Stop
        return real_rank(requests, *args, **kwargs)

    stopped = AnswerChunksDataset(str(tmp_path / "stopped"))
    monkeypatch.setattr(ranker, "rank", rank_then_stop)
    with pytest.raises(DatasetError):
        stopped.save(_job(ranker, tmp_path / "in"))
    with pytest.raises(DatasetError, match="did not finish"):
        stopped.load()  # a stopped batch is never read
    assert sorted(p.name for p in (tmp_path / "stopped").glob("part-*")) == ["part-000000.parquet"]
    monkeypatch.setattr(
        ranker, "rank", lambda requests, *a, **k: answered.append(len(requests)) or real_rank(requests)
    )
    stopped.save(_job(ranker, tmp_path / "in"))
    assert answered == [4, 2, 2, 3]  # chunk 0 once; the rerun answers chunks 1 and 2 only
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "stopped").drop(columns="latency_ms"), expected)
    stopped.save(_job(ranker, tmp_path / "in"))  # complete: nothing is answered twice
    assert answered == [4, 2, 2, 3]
    stopped.save(_job(ranker, tmp_path / "in", digest="model-b"))  # another model: afresh
    assert answered == [4, 2, 2, 3, 4, 2, 3]
    report = summarize(stopped.load(), "models:/m@champion")
    assert (report["requests"], report["served"], report["refused"]) == (11, 9, 2)
    assert [r["position"] for r in report["refusals"]] == [6, 7]


def test_another_input_or_chunking_is_another_key(world: World, ranker: Ranker, tmp_path: Path) -> None:
    (tmp_path / "day.jsonl").write_text(json.dumps(_requests(world, 1)[0]) + "\n")
    first = _job(ranker, tmp_path).key
    assert _job(ranker, tmp_path, chunk_size=8).key != first
    (tmp_path / "day.jsonl").write_text(json.dumps(_requests(world, 2)[1]) + "\n")
    assert _job(ranker, tmp_path).key != first


def test_an_empty_request_folder_is_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=f"no request file in {tmp_path}"):
        RequestFilesDataset(str(tmp_path)).load()
    with pytest.raises(DatasetError, match="holds no batch"):
        AnswerChunksDataset(str(tmp_path / "none")).load()
