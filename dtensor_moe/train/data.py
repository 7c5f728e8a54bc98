"""Training data that needs no download: the shipped corpus (byte-level) or a synthetic stream.

The global batch of a step is a pure function of (seed, step), so it is identical for every mesh.
It is `microbatches` contiguous microbatches; each data-parallel rank takes its own contiguous
slice of every microbatch, so its rows, split into `microbatches` chunks, are its share of each.
Under context parallelism each CP rank takes its contiguous part of every sequence of its slice.
"""

from importlib import resources

import torch

VOCAB_SIZE = 256  # byte-level tokenizer


def encode(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


def corpus_tokens() -> torch.Tensor:
    text = resources.files("dtensor_moe.corpus").joinpath("kjv_genesis_judges.txt").read_text(encoding="utf-8")
    return encode(text)


def synthetic_tokens(n: int = 1 << 20, seed: int = 0) -> torch.Tensor:
    """A low-entropy Markov chain over bytes: learnable, so the loss visibly falls."""
    g = torch.Generator().manual_seed(seed)
    next_VC = torch.randint(0, VOCAB_SIZE, (VOCAB_SIZE, 4), generator=g).tolist()
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
    def __init__(self, tokens: torch.Tensor, seq_len: int, global_batch: int, seed: int, dp_rank: int, dp_size: int,
                 cp_rank: int = 0, cp: int = 1, microbatches: int = 1):
        check_global_batch(global_batch, dp_size, microbatches)
        if seq_len % cp:
            raise ValueError(f"training.seq_len ({seq_len}) must be divisible by parallel.cp ({cp})")
        if tokens.numel() <= seq_len + 1:
            raise ValueError(f"training.seq_len ({seq_len}) must be shorter than the corpus ({tokens.numel()} tokens)")
        self.tokens, self.seq_len, self.global_batch, self.seed = tokens, seq_len, global_batch, seed
        self.microbatches, self.dp_size, self.dp_rank = microbatches, dp_size, dp_rank
        part = seq_len // cp
        self.cols = slice(cp_rank * part, (cp_rank + 1) * part)

    def __call__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs_BL, targets_BL) of this rank at `step`."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, self.tokens.numel() - self.seq_len - 1, (self.global_batch,), generator=g)
        starts = starts.view(self.microbatches, self.dp_size, -1)[:, self.dp_rank].flatten()
        idx_BL = starts[:, None] + torch.arange(self.seq_len + 1)
        seq = self.tokens[idx_BL]
        return seq[:, :-1][:, self.cols], seq[:, 1:][:, self.cols]
