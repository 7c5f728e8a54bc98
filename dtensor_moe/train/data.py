"""Training data: the shipped corpus (byte-level), a synthetic stream, or the user's files' token cache.

The global batch of a step is a pure function of (seed, step), so it is identical for every mesh.
It is `microbatches` contiguous microbatches; each data-parallel rank takes its own contiguous
slice of every microbatch, so its rows, split into `microbatches` chunks, are its share of each.
Under context parallelism each CP rank takes its contiguous part of every sequence of its slice.
The corpus and synthetic sources draw windows at random offsets (`Batches`); the user's files are packed
into consecutive sequences, each read once per epoch in a shuffled order (`PackedBatches`). Held-out
sequences (`EvalBatches`) are the same ones at every evaluation, split over the ranks the same way.
"""

import math
import os
from importlib import resources

import torch

from dtensor_moe.train.config import BYTE_VOCAB

EPOCH_SEED = 0x5EED_E90C  # epoch permutations draw from other seeds than the random windows' steps


def encode(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


def corpus_tokens() -> torch.Tensor:
    text = resources.files("dtensor_moe.corpus").joinpath("kjv_genesis_judges.txt").read_text(encoding="utf-8")
    return encode(text)


def synthetic_tokens(n: int = 1 << 20, seed: int = 0) -> torch.Tensor:
    """A low-entropy Markov chain over bytes: learnable, so the loss visibly falls."""
    g = torch.Generator().manual_seed(seed)
    next_VC = torch.randint(0, BYTE_VOCAB, (BYTE_VOCAB, 4), generator=g).tolist()
    choice = torch.randint(0, 4, (n,), generator=g).tolist()
    out, tok = [0] * n, 0
    for i in range(1, n):
        tok = out[i] = next_VC[tok][choice[i]]
    return torch.tensor(out)


def load_tokens(source: str, seed: int = 0) -> torch.Tensor:
    if source == "corpus":
        return corpus_tokens()
    if source == "synthetic":
        return synthetic_tokens(seed=seed)
    raise ValueError(f"data.source must be 'corpus' or 'synthetic', got {source!r}")


def check_global_batch(global_batch: int, dp_size: int, microbatches: int = 1):
    n = dp_size * microbatches
    if global_batch % n != 0:
        what = f"the data-parallel size ({dp_size})" + (f" times parallel.microbatches ({microbatches}) = {n}"
                                                         if microbatches > 1 else "")
        raise ValueError(f"training.global_batch ({global_batch}) must be divisible by {what}; "
                         f"e.g. {[n * k for k in (1, 2, 4)]}")


class Batches:
    """Random windows of seq_len + 1 tokens: (inputs, targets) of this rank at each step."""

    SLACK = 1  # tokens beyond one window that a random offset needs (the consecutive sequences below need none)

    def __init__(self, tokens: torch.Tensor, seq_len: int, global_batch: int, seed: int, dp_rank: int, dp_size: int,
                 cp_rank: int = 0, cp: int = 1, microbatches: int = 1):
        check_global_batch(global_batch, dp_size, microbatches)
        if seq_len % cp:
            raise ValueError(f"training.seq_len ({seq_len}) must be divisible by parallel.cp ({cp})")
        if tokens.numel() <= seq_len + self.SLACK:
            raise ValueError(f"training.seq_len ({seq_len}) must be shorter than the corpus ({tokens.numel()} tokens)")
        self.tokens, self.seq_len, self.global_batch, self.seed = tokens, seq_len, global_batch, seed
        self.microbatches, self.dp_size, self.dp_rank = microbatches, dp_size, dp_rank
        part = seq_len // cp
        self.cols = slice(cp_rank * part, (cp_rank + 1) * part)

    def starts(self, step: int) -> torch.Tensor:
        """The first token of every sequence of the global batch at `step`."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        return torch.randint(0, self.tokens.numel() - self.seq_len - 1, (self.global_batch,), generator=g)

    def rank_starts(self, step: int) -> torch.Tensor:
        """The first token of each of this rank's sequences at `step`: its slice of every microbatch."""
        return self.starts(step).view(self.microbatches, self.dp_size, -1)[:, self.dp_rank].flatten()

    def __call__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs_BL, targets_BL) of this rank at `step`."""
        idx_BL = self.rank_starts(step)[:, None] + torch.arange(self.seq_len + 1)
        seq = self.tokens[idx_BL].long()  # a token cache stores uint16 or int32
        return seq[:, :-1][:, self.cols], seq[:, 1:][:, self.cols]


class PackedBatches(Batches):
    """The token stream cut into consecutive sequences (sequence i: tokens [i L, i L + L], its last token the next
    one's first), read in epochs: global sample j of the run is sequence perm_e[j mod n] of epoch e = j // n, the
    permutation seeded by (seed, e). Every sequence once per epoch, a pure function of (seed, step)."""

    SLACK = 0

    def __init__(self, tokens: torch.Tensor, seq_len: int, global_batch: int, seed: int, dp_rank: int, dp_size: int,
                 cp_rank: int = 0, cp: int = 1, microbatches: int = 1, prefetch=None):
        super().__init__(tokens, seq_len, global_batch, seed, dp_rank, dp_size, cp_rank, cp, microbatches)
        # prefetch(starts, length): asks for the next step's tokens while this step trains (token_cache.prefetcher),
        # so a cache that is not in memory costs the step no disk reads.
        self.prefetch = prefetch
        self.n_seq = (tokens.numel() - 1) // seq_len
        if self.n_seq < global_batch:
            raise ValueError(f"{tokens.numel()} training tokens hold {self.n_seq} sequences of training.seq_len "
                             f"({seq_len}) + 1, fewer than training.global_batch ({global_batch})")
        self._perms: dict[int, torch.Tensor] = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            if len(self._perms) > 1:  # a step spans at most two epochs
                del self._perms[min(self._perms)]
            g = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) ^ EPOCH_SEED)
            self._perms[epoch] = torch.randperm(self.n_seq, generator=g)
        return self._perms[epoch]

    def starts(self, step: int) -> torch.Tensor:
        j = torch.arange(step * self.global_batch, (step + 1) * self.global_batch)
        epoch, i = j // self.n_seq, j % self.n_seq
        seq = torch.empty_like(j)
        for e in epoch.unique().tolist():
            sel = epoch == e
            seq[sel] = self._perm(e)[i[sel]]
        return seq * self.seq_len

    def __call__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        batch = super().__call__(step)
        if self.prefetch is not None:
            self.prefetch(self.rank_starts(step + 1), self.seq_len + 1)
        return batch

    def epoch(self, step: int) -> float:
        """Epochs of training data read after `step` steps."""
        return step * self.global_batch / self.n_seq


class EvalBatches(Batches):
    """The held-out tokens' first `batches` global batches of consecutive sequences (fewer when they hold fewer;
    the last one filled by wrapping around): the same sequences at every evaluation, on every mesh."""

    SLACK = 0

    def __init__(self, tokens: torch.Tensor, seq_len: int, global_batch: int, batches: int, dp_rank: int,
                 dp_size: int, cp_rank: int = 0, cp: int = 1, microbatches: int = 1):
        super().__init__(tokens, seq_len, global_batch, 0, dp_rank, dp_size, cp_rank, cp, microbatches)
        self.n_seq = (tokens.numel() - 1) // seq_len
        self.batches = min(batches, math.ceil(self.n_seq / global_batch))
        self.tokens_per_eval = min(self.n_seq, self.batches * global_batch) * seq_len

    def starts(self, step: int) -> torch.Tensor:
        return torch.arange(step * self.global_batch, (step + 1) * self.global_batch) % self.n_seq * self.seq_len

    def __iter__(self):
        return (self(b) for b in range(self.batches))


def load_data(cfg) -> tuple[torch.Tensor, torch.Tensor | None, dict]:
    """(training tokens, held-out tokens or None, what they are) of a train Config: the corpus or synthetic stream
    (its last data.eval_fraction held out), or the files' token cache (token_cache.py)."""
    d = cfg.data
    if d.source == "files":
        from dtensor_moe.train.token_cache import open_tokens

        train, held, meta = open_tokens(cfg)
        return train, held, {"source": "files", "files": len(meta["files"]["train"]) + len(meta["files"]["eval"]),
                             "documents": sum(meta["documents"].values()), "tokenizer": meta["tokenizer"],
                             "train_tokens": train.numel(), "eval_tokens": 0 if held is None else held.numel(),
                             "cache": meta["cache"]}
    tokens = load_tokens(d.source, cfg.training.seed)
    cut = tokens.numel() - math.ceil(tokens.numel() * d.eval_fraction)
    train, held = (tokens[:cut], tokens[cut:]) if d.eval_fraction else (tokens, None)
    return train, held, {"source": d.source, "train_tokens": train.numel(),
                         "eval_tokens": 0 if held is None else held.numel()}


def data_fingerprint(cfg, cache_dir: str | None = None) -> dict:
    """What decides the training and held-out token streams, saved in every checkpoint (so `--resume` can refuse a
    changed stream): the source, the files' content with their tokenizer (the token cache's key, `cache_dir`'s
    name; computed when not given), the held-out fraction and the order's seed."""
    d = cfg.data
    content = None
    if d.source == "files":
        if cache_dir is None:
            from dtensor_moe.train.token_cache import plan_cache

            cache_dir = plan_cache(cfg).dir
        content = os.path.basename(cache_dir)
    return {"source": d.source, "content": content, "eval_fraction": d.eval_fraction, "seed": cfg.training.seed}


# What each fingerprint entry is, as a user changes it.
_FINGERPRINT = {"source": "data.source", "content": "the data files' content or their tokenizer (data.paths, "
                "data.eval_paths, data.tokenizer)", "eval_fraction": "data.eval_fraction", "seed": "training.seed"}


def fingerprint_diff(saved: dict, now: dict) -> list[str]:
    """Each entry of two data fingerprints that differs, named as a user changes it."""
    return [f"{_FINGERPRINT[k]}: saved {saved[k]!r} vs now {now.get(k)!r}" if k != "content" else _FINGERPRINT[k]
            for k in _FINGERPRINT if k in saved and saved[k] != now.get(k)]


def rank_batches(cfg, dims, rank: int, train: torch.Tensor, held: torch.Tensor | None, cache: str | None = None):
    """(this rank's training batches, its held-out batches or None). TP ranks read the same sequences (the
    embedding splits them); CP ranks each their part of them; pipeline stages the same as every other stage.
    `cache`: the token cache directory `train` maps (load_data's info), whose next-step pages are prefetched."""
    t, coords = cfg.training, dims.dense_coords(rank)
    dp_rank, dp_size = coords["dp_replicate"] * dims.dp_shard + coords["dp_shard"], dims.dp_replicate * dims.dp_shard
    split = dict(cp_rank=coords["cp"], cp=dims.cp, microbatches=cfg.parallel.num_microbatches)
    if cfg.data.source == "files":
        from dtensor_moe.train.token_cache import prefetcher

        batches = PackedBatches(train, t.seq_len, t.global_batch, t.seed, dp_rank, dp_size, **split,
                                prefetch=prefetcher(cache, train.element_size()) if cache else None)
    else:
        batches = Batches(train, t.seq_len, t.global_batch, t.seed, dp_rank, dp_size, **split)
    evals = None if held is None else EvalBatches(held, t.seq_len, t.global_batch, cfg.data.eval_batches, dp_rank,
                                                   dp_size, **split)
    return batches, evals
