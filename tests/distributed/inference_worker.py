"""One inference node (`rerank_ar_rl`, then `rerank_rl` choosing its operating point) in one process
or as one of the processes of a launch: ``torchrun --standalone --nproc_per_node 2 -m
tests.distributed.inference_worker OUT``. Rank 0 writes both systems' rankings to OUT/rankings.parquet."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pandas as pd
import torch

from diffusion_gr2.core.decode import decoder
from diffusion_gr2.pipelines.inference.nodes import make_rerank_node
from tests.core.model.tiny import tiny_model_for
from tests.core.rank.world import make_world
from tests.test_pipeline_inference import _params, _policy

USERS = 9  # 9 requests a split in batches of 2: five batches, three for rank 0, two for rank 1

# the inference tests' settings (one candidate tau: the choice cannot depend on timings; every bar
# open: untrained models), with a grammar and batches of two
PARAMS = _params(None) | {
    "valid_sweep": [],
    "decoding": {"max_new_tokens": 12, "batch_size": 2, "constrained": True, "device": "cpu"},
}
POLICY = _policy()


def _count_decoded_rows() -> list[int]:
    """Count the rows this process decodes (the decoder's batches), to see each did its share."""
    count = [0]
    real = decoder._decode_batch

    def counted(model, prompts, *args, **kwargs):  # noqa: ANN001, ANN202 (the decoder's own signature)
        count[0] += len(prompts)
        return real(model, prompts, *args, **kwargs)

    decoder._decode_batch = counted
    return count


def main(out: Path) -> None:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        torch.distributed.init_process_group("gloo")
    torch.set_num_threads(1)
    decoded = _count_decoded_rows()
    tokenizer, requests = make_world(n_users=USERS, splits=("test", "valid"))
    torch.manual_seed(0)
    ar_model, diffusion = tiny_model_for(tokenizer), tiny_model_for(tokenizer, block_size=4)
    ar = make_rerank_node("ar_rl")(ar_model, requests, tokenizer, PARAMS, POLICY)
    rl = make_rerank_node("rl")(diffusion, requests, tokenizer, PARAMS, POLICY, ar, ar_model)
    rank = int(os.environ.get("RANK", "0"))
    (out / f"decoded-{rank}.txt").write_text(str(decoded[0]))  # rows this process decoded itself
    if rank == 0:
        frame = pd.concat([ar["rankings"], rl["rankings"]], ignore_index=True)
        frame.assign(chosen_tau=rl["operating_point"]["tau"]).to_parquet(out / "rankings.parquet")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
