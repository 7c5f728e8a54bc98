"""The tokenizer data.source = "files" reads text with: UTF-8 bytes, or a Hugging Face tokenizer directory.

`fingerprint` names a tokenizer by its files' content (torch- and transformers-free: the ranks key the token
cache with it); `load_tokenizer` loads it to encode, which only the process that builds the cache does.
"""

import hashlib
import importlib.util
import os
from dataclasses import dataclass

from dtensor_moe.train.config import BYTE_VOCAB

BYTE = "byte"
# The files that decide how a Hugging Face tokenizer encodes (not the model's weights or config.json).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model",
                   "sentencepiece.bpe.model")


def _describe(spec: str, hf_path: str) -> str:
    return "data.tokenizer" if spec != hf_path else "model.hf_path (its tokenizer, data.tokenizer's default)"


def tokenizer_files(spec: str, hf_path: str = "") -> list[str]:
    """The tokenizer files of directory `spec`; a ValueError names the field when there are none."""
    what = _describe(spec, hf_path)
    if not os.path.isdir(spec):
        raise ValueError(f"{what} {spec!r} is not a directory; valid: 'byte', or a Hugging Face tokenizer directory "
                         f"(what save_pretrained writes: {', '.join(TOKENIZER_FILES[:2])}, ...)")
    found = [os.path.join(spec, f) for f in TOKENIZER_FILES if os.path.isfile(os.path.join(spec, f))]
    if not found:
        hint = "; give data.tokenizer = a tokenizer directory, or 'byte'" if spec == hf_path else ""
        raise ValueError(f"{what} {spec!r} holds no tokenizer files (one of {', '.join(TOKENIZER_FILES)}){hint}")
    return found


def fingerprint(spec: str, hf_path: str = "") -> str:
    """What the token cache is keyed by: 'byte', or the tokenizer files' content and the tokenizers version."""
    if spec == BYTE:
        return "byte-utf8"
    h = hashlib.sha256()
    for path in tokenizer_files(spec, hf_path):
        with open(path, "rb") as f:
            h.update(os.path.basename(path).encode() + b"\0" + hashlib.sha256(f.read()).digest())
    # A new tokenizers release may split text differently: a cache it did not build is rebuilt.
    try:
        import tokenizers

        h.update(f"tokenizers {tokenizers.__version__}".encode())
    except ImportError:  # a tokenizer without the tokenizers library (sentencepiece only)
        pass
    return h.hexdigest()


@dataclass
class Tokenizer:
    """encode(texts) -> each text's token ids, without special tokens; `eot` joins documents."""

    name: str
    vocab: int  # ids are < vocab
    eot: int
    hf: object = None

    def encode(self, texts: list[str]) -> list[list[int]]:
        if self.hf is None:
            return [list(t.encode("utf-8")) for t in texts]
        # verbose=False: a document longer than the model's context is no problem here (it is packed, not truncated).
        return self.hf(texts, add_special_tokens=False, return_attention_mask=False, verbose=False)["input_ids"]


def load_tokenizer(spec: str, hf_path: str = "") -> Tokenizer:
    """'byte' (documents joined by byte 0, which text does not contain), or a Hugging Face tokenizer directory
    (joined by its end-of-text token), loaded from local files only."""
    if spec == BYTE:
        return Tokenizer("byte", BYTE_VOCAB, 0)
    tokenizer_files(spec, hf_path)
    what = _describe(spec, hf_path)
    if importlib.util.find_spec("transformers") is None:
        raise ValueError(f"{what} {spec!r} needs transformers (>= 5) to read the tokenizer: "
                         "pip install 'dtensor_moe[data]'")
    import transformers

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # its notes on a tokenizer saved by another version are no concern
    try:
        tok = transformers.AutoTokenizer.from_pretrained(spec, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - any failure to load is bad input, said in one line
        raise ValueError(f"{what} {spec!r} cannot be loaded as a Hugging Face tokenizer: {type(e).__name__}: "
                         f"{' '.join(str(e).split())[:300]}") from None
    finally:
        transformers.logging.set_verbosity(verbosity)
    eot = tok.eos_token_id if tok.eos_token_id is not None else tok.sep_token_id
    if eot is None:
        raise ValueError(f"{what} {spec!r} has no end-of-text token (eos_token) to join documents with; set "
                         "eos_token in its tokenizer_config.json")
    return Tokenizer(spec, len(tok), int(eot), tok)
