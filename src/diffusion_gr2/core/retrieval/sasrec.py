"""A small SASRec-style first-stage retriever (Kang & McAuley 2018), trained on training prefixes.

Shapes: `b` batch of sequences, `l` sequence length (`max_len`), `e` model width, `i` catalog size,
`u` users. Item id x is stored as token x + 1; token 0 is left padding.

Training is sequence-to-sequence next-item prediction with a full softmax over the catalog (cheap at a
few thousand items), early-stopped on validation Recall@k. Only the training part of each user is ever
used as a target, so the validation and test items stay held out.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from diffusion_gr2.core.retrieval.evaluation import evaluate_scorer, histories_before_valid, mask_history

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetrieverConfig:
    dim: int = 64  # model width e
    heads: int = 2  # attention heads per block
    blocks: int = 2  # transformer blocks
    max_len: int = 50  # most recent items the model reads; longer train parts are cut into windows
    dropout: float = 0.2  # on embeddings, attention and MLP (SASRec uses 0.2 on MovieLens)
    lr: float = 5e-3  # AdamW, constant; high because training is short (cosine decay did worse here)
    weight_decay: float = 0.0  # SASRec trains without decay
    batch_size: int = 256  # windows per step; faster per epoch than 128 on 2 cores, same accuracy
    max_epochs: int = 20  # upper bound: ~2.2 s an epoch on ml-100k (2 idle cores) keeps training < 90 s
    patience: int = 5  # epochs without a better validation Recall@k before stopping
    k: int = 10  # cutoff of the validation metric
    seed: int = 0  # fixes initialisation, dropout and batch order


class Block(nn.Module):
    """Pre-norm transformer block: masked self-attention + MLP, both residual."""

    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.Dropout(dropout)
        )

    def forward(self, x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """x: [b, l, e], allowed: [b, 1, l, l] bool (True = may attend) -> [b, l, e]."""
        b, l, e = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(e, dim=-1)
        # [b, l, e] -> [b, heads, l, e / heads]
        q, k, v = (t.view(b, l, self.heads, e // self.heads).transpose(1, 2) for t in (q, k, v))
        p = self.dropout if self.training else 0.0
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=p)
        x = x + self.proj(att.transpose(1, 2).reshape(b, l, e))
        return x + self.mlp(self.norm2(x))


class SASRec(nn.Module):
    """Item + learned position embeddings -> causal transformer blocks -> scores against item embeddings."""

    def __init__(self, num_items: int, config: RetrieverConfig) -> None:
        super().__init__()
        self.num_items, self.max_len = num_items, config.max_len
        self.item_emb = nn.Embedding(num_items + 1, config.dim, padding_idx=0)
        self.pos_emb = nn.Embedding(config.max_len, config.dim)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(
            Block(config.dim, config.heads, config.dropout) for _ in range(config.blocks)
        )
        self.norm = nn.LayerNorm(config.dim)
        # Small embeddings keep the tied output logits (|h| ~ sqrt(e) after the final norm) near unit scale.
        nn.init.normal_(self.item_emb.weight, std=config.dim**-0.5)
        nn.init.normal_(self.pos_emb.weight, std=config.dim**-0.5)
        with torch.no_grad():
            self.item_emb.weight[0].zero_()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: [b, l] left-padded (0 = pad) -> hidden states [b, l, e]."""
        b, l = tokens.shape
        x = self.item_emb(tokens) + self.pos_emb.weight[-l:]
        x = self.drop(x) * (tokens > 0).unsqueeze(-1)  # padding carries nothing
        causal = torch.ones(l, l, dtype=torch.bool, device=tokens.device).tril()
        # A query may see earlier real items; it always sees itself so no row is fully masked (NaN).
        allowed = causal & ((tokens > 0).unsqueeze(1) | torch.eye(l, dtype=torch.bool, device=tokens.device))
        allowed = allowed.unsqueeze(1)  # [b, 1, l, l]
        for block in self.blocks:
            x = block(x, allowed)
        return self.norm(x)

    def item_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [..., e] -> [..., i] scores for item ids 0..i-1 (the padding row is left out)."""
        return hidden @ self.item_emb.weight[1:].T


def left_pad(sequences: Sequence[Sequence[int]], length: int) -> torch.Tensor:
    """Item-id sequences -> [b, length] tokens (id + 1), keeping the last `length` items, 0 on the left."""
    out = torch.zeros(len(sequences), length, dtype=torch.long)
    for row, seq in enumerate(sequences):
        tail = list(seq)[-length:]
        if tail:
            out[row, length - len(tail) :] = torch.tensor(tail, dtype=torch.long) + 1
    return out


@dataclass
class TrainedRetriever:
    """The best model (restored after early stopping) and how training went."""

    model: SASRec
    best_epoch: int
    valid_recall: float  # Recall@k on validation point 0 (`valid_item`) at best_epoch
    curve: list[dict] = field(default_factory=list)  # per epoch: epoch, loss, valid recall@k
    seconds: float = 0.0


@torch.no_grad()
def score_users(model: SASRec, histories: Sequence[Sequence[int]], batch_size: int = 512) -> np.ndarray:
    """Full-catalog scores [u, i] (float32) for the next item after each history; history items are -inf.

    The model reads the last `max_len` items of each history; masking uses the whole history, so an
    item seen long ago is never proposed either.
    """
    was_training = model.training
    model.eval()
    out = np.empty((len(histories), model.num_items), dtype=np.float32)
    for start in range(0, len(histories), batch_size):
        tokens = left_pad(list(histories[start : start + batch_size]), model.max_len)  # [b, l]
        out[start : start + len(tokens)] = model.item_logits(model(tokens)[:, -1]).numpy()
    model.train(was_training)
    return mask_history(out, histories)


def training_windows(histories: Sequence[Sequence[int]], max_len: int) -> list[tuple[list[int], int]]:
    """Cut each training part into windows of up to max_len + 1 items, from the end backwards.

    Returns (window, skip) pairs: the last `skip` targets of a window were already targets of a later
    window, so every item after a user's first is a target exactly once. The oldest window is taken at
    full length (hence the skip) rather than left short, so batches carry less padding.
    """
    windows = []
    for history in histories:
        items, end = list(history), len(history)
        while end >= 2:
            start = end - max_len - 1
            if start >= 0:
                windows.append((items[start:end], 0))
            else:
                stop = min(len(items), max_len + 1)
                windows.append((items[:stop], stop - end))
            end -= max_len
    return windows


def epoch_batches(lengths: np.ndarray, batch_size: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Window indices grouped into batches of similar length (less padding), batches in random order."""
    order = np.lexsort((rng.random(len(lengths)), lengths))  # by length, random among equal lengths
    batches = [order[k : k + batch_size] for k in range(0, len(order), batch_size)]
    return [batches[k] for k in rng.permutation(len(batches))]


def batch_tensors(batch: list[tuple[list[int], int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Windows -> (inputs [b, l], targets [b, l]) with l = longest window - 1; target -1 = no loss."""
    length = max(len(w) for w, _ in batch) - 1
    inputs = left_pad([w[:-1] for w, _ in batch], length)
    targets = left_pad([w[1:] for w, _ in batch], length) - 1
    for row, (_, skip) in enumerate(batch):
        if skip:
            targets[row, length - skip :] = -1
    return inputs, targets


def _run_epoch(
    model: SASRec,
    windows: list[tuple[list[int], int]],
    batches: list[np.ndarray],
    optimiser: torch.optim.Optimizer,
) -> float:
    """One pass over the batches; mean next-item cross-entropy (full softmax) over target positions."""
    model.train()
    total, count = 0.0, 0
    for index in batches:
        inputs, targets = batch_tensors([windows[j] for j in index])  # [b, l] each
        keep = targets >= 0
        # Scoring only positions with a target skips the padding in the [*, i] logits (the costly part).
        logits = model.item_logits(model(inputs)[keep])  # [m, i]
        loss = F.cross_entropy(logits, targets[keep])
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        optimiser.step()
        total, count = total + loss.item() * len(logits), count + len(logits)
    return total / max(count, 1)


def train_retriever(splits: pd.DataFrame, num_items: int, config: RetrieverConfig) -> TrainedRetriever:
    """Train SASRec on the training parts; early-stop on Recall@k of validation point 0 (`valid_item`,
    history = the train part, one target per user).

    Point 0 only: scoring every validation point (7 per user by default) took 2.8x as long each
    epoch (4.9 s against 1.7 s on two loaded cores), and the best epoch was among the last of the 20
    either way (17 on point 0, 19 on every point, ml-100k).

    Deterministic under `config.seed` (the global torch RNG is forked, so the caller's state is untouched).
    """
    started = time.perf_counter()
    histories = histories_before_valid(splits)
    valid_targets = splits["valid_item"].to_numpy(dtype=np.int64)
    windows = training_windows(histories, config.max_len)
    lengths = np.array([len(w) for w, _ in windows])
    rng = np.random.default_rng(config.seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model = SASRec(num_items, config)
        optimiser = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
        best = (-1.0, 0, copy.deepcopy(model.state_dict()))
        curve: list[dict] = []
        bar = tqdm(range(1, config.max_epochs + 1), desc="sasrec", leave=False)
        for epoch in bar:
            loss = _run_epoch(model, windows, epoch_batches(lengths, config.batch_size, rng), optimiser)
            scores = evaluate_scorer(lambda h: score_users(model, h), histories, valid_targets, config.k)
            recall = scores[f"recall@{config.k}"]
            curve.append({"epoch": epoch, "loss": loss, f"valid_recall@{config.k}": recall})
            bar.set_postfix(loss=f"{loss:.3f}", val=f"{recall:.4f}", refresh=False)
            if recall > best[0]:
                best = (recall, epoch, copy.deepcopy(model.state_dict()))
            elif epoch - best[1] >= config.patience:
                break
    model.load_state_dict(best[2])
    model.eval()
    seconds = time.perf_counter() - started
    logger.info("SASRec: best epoch %d, valid Recall@%d %.4f, %.1f s", best[1], config.k, best[0], seconds)
    return TrainedRetriever(model, best[1], best[0], curve, seconds)
