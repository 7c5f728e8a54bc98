"""Regenerates the tiny corpus and tokenizer shipped for CPU runs of the torchtitan hook.

    python -m dtensor_moe.titan_data.make

corpus/train.jsonl: synthetic English-like documents (counting, arithmetic and templated
sentences), one {"text": ...} per line, the layout of torchtitan's c4_test set.
tokenizer/: a byte-level BPE trained on that corpus (at most 512 entries; 382 come out), with
BOS/EOS tokens.
Deterministic: the same files come out on every run.
"""

import json
import random
from pathlib import Path

HERE = Path(__file__).parent
NUMBERS = "zero one two three four five six seven eight nine ten eleven twelve".split()
ANIMALS = "cat dog fox owl bee ant cow hen pig rat yak elk".split()
VERBS = "sees follows helps finds likes meets".split()
PLACES = "the river,the hill,the farm,the forest,the town,the lake".split(",")
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


def _sentence(rng: random.Random) -> str:
    kind = rng.randrange(3)
    if kind == 0:
        a, b = rng.randrange(7), rng.randrange(6)
        return f"{NUMBERS[a]} plus {NUMBERS[b]} is {NUMBERS[a + b]}."
    if kind == 1:
        start = rng.randrange(8)
        return "counting: " + " ".join(NUMBERS[start : start + 5]) + "."
    a, b = rng.sample(ANIMALS, 2)
    return f"the {a} {rng.choice(VERBS)} the {b} near {rng.choice(PLACES)}."


def documents(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(_sentence(rng) for _ in range(rng.randrange(4, 12))) for _ in range(n)]


def main():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    docs = documents(800)
    corpus = HERE / "corpus"
    corpus.mkdir(exist_ok=True)
    (corpus / "train.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512, special_tokens=[BOS, EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(docs, trainer)
    out = HERE / "tokenizer"
    out.mkdir(exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": EOS, "add_bos_token": True, "add_eos_token": True}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


if __name__ == "__main__":
    main()
