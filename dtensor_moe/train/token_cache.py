"""The token cache of data.source = "files": the files tokenized once into one memory-mapped array.

The launcher calls `prepare` before any rank starts: it finds and checks the files, and on a cache miss tokenizes
them (a progress bar on stderr) into CACHE_ROOT/<key>/tokens.bin, training files first, then data.eval_paths',
documents joined by the tokenizer's end-of-text token. The key is a hash of the files' content, the tokenizer's
files and the storage dtype, so an edited file or another tokenizer builds a new cache and the next run with the
same inputs reuses it. Ranks call `open_tokens`: they recompute the key (file digests come from a memo keyed by
path, size and mtime, so they read no data file) and memory-map the array; training reads nothing else.

Written atomically: a build goes to a temporary directory renamed into place, and a lock file makes a second run
that wants the same cache wait for the first instead of building it twice.
"""

import array
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass

from dtensor_moe.durable import fsync_path, write_atomic
from dtensor_moe.train.config import BYTE_VOCAB
from dtensor_moe.train.data_files import DataFile, documents, find_files, token_shard
from dtensor_moe.train.tokenizer import fingerprint, load_tokenizer

VERSION = 1
DOCS_PER_BATCH = 512  # documents per tokenizer call: the fast tokenizers encode a batch in parallel
# Storage dtype per token: 2 bytes while the ids fit (vocabularies up to 65,536), else 4.
DTYPES = {"uint16": "H", "int32": "i"}


def cache_root(data) -> str:
    """data.cache_dir, else $DTENSOR_MOE_CACHE, else $XDG_CACHE_HOME/dtensor_moe/tokens (~/.cache/...)."""
    if data.cache_dir:
        return os.path.expanduser(data.cache_dir)
    if os.environ.get("DTENSOR_MOE_CACHE"):
        return os.environ["DTENSOR_MOE_CACHE"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(base, "dtensor_moe", "tokens")


def storage_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "int32"


@dataclass(frozen=True)
class CachePlan:
    """What a cache is built from and where it lives (no file read but the digests' memo misses)."""

    train: list[DataFile]
    eval: list[DataFile]
    tokenizer: str  # "byte" or a directory
    dtype: str
    key: str
    dir: str

    @property
    def files(self) -> list[DataFile]:
        return self.train + self.eval


def _stamp(st: os.stat_result) -> list[int]:
    """What the digest memo trusts a file by: size, mtime, and the status-change time and inode, which `cp -p` /
    `rsync -t` (mtime kept) and an editor's save-by-rename change too, and no user can set back."""
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def _digests(files: list[DataFile], root: str) -> list[str]:
    """Each file's content sha256, through root/digests.json (path and `_stamp` -> digest): a rank opening the
    cache reads no data file. Two runs updating the memo at once lose an entry at worst (it is recomputed)."""
    memo_path = os.path.join(root, "digests.json")
    try:
        with open(memo_path) as f:
            memo = json.load(f)
    except (OSError, ValueError):
        memo = {}
    out, changed = [], False
    for df in files:
        st = os.stat(df.path)
        real = os.path.realpath(df.path)
        entry = memo.get(real)
        if entry and entry[:-1] == _stamp(st):
            out.append(entry[-1])
            continue
        h = hashlib.sha256()
        with open(df.path, "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
        memo[real] = [*_stamp(st), h.hexdigest()]
        out.append(h.hexdigest())
        changed = True
    if changed:
        try:
            os.makedirs(root, exist_ok=True)
            write_atomic(memo_path, lambda f: f.write(json.dumps(memo).encode()))
        except OSError:  # a read-only cache directory: the digests are recomputed next time
            pass
    return out


def plan_cache(cfg) -> CachePlan:
    """The files, the tokenizer and the cache directory of `cfg` (a train Config with data.source = 'files')."""
    d, m = cfg.data, cfg.model
    train = find_files(d.paths, "paths")
    held = find_files(d.eval_paths, "eval_paths") if d.eval_paths else []
    overlap = {os.path.realpath(f.path) for f in train} & {os.path.realpath(f.path) for f in held}
    if overlap:
        raise ValueError(f"data.eval_paths and data.paths both match {sorted(overlap)[0]!r}: held-out data must not "
                         "be trained on; narrow one of the patterns")
    spec = d.resolved_tokenizer(m.hf_path)
    texts = any(f.format != "tokens" for f in train + held)
    if texts and not d.tokenizer and not m.hf_path and m.vocab_size > BYTE_VOCAB:
        raise ValueError(
            f"data.tokenizer is needed for model.vocab_size ({m.vocab_size}) > {BYTE_VOCAB}: give "
            "data.tokenizer = a Hugging Face tokenizer directory, or data.tokenizer = 'byte' (ids 0..255) on "
            "purpose; with model.hf_path the checkpoint's own tokenizer is the default"
        )
    root = cache_root(d)
    digests = _digests(train + held, root)
    trained = dict(zip(digests[:len(train)], train))
    same = [(trained[h].path, f.path) for f, h in zip(held, digests[len(train):]) if h in trained]
    if same:
        raise ValueError(f"data.eval_paths file {same[0][1]!r} has the content of data.paths file {same[0][0]!r} "
                         f"(the same sha256{f'; {len(same)} such files' if len(same) > 1 else ''}): held-out data "
                         "must not be trained on; hold out other files")
    dtype = storage_dtype(m.vocab_size)
    key = json.dumps({
        "version": VERSION, "dtype": dtype, "byteorder": sys.byteorder,
        "train": [[f.format, h] for f, h in zip(train, digests)],
        "eval": [[f.format, h] for f, h in zip(held, digests[len(train):])],
        # Only text is tokenized: token shards alone keep their cache whatever the tokenizer.
        "tokenizer": fingerprint(spec, m.hf_path) if texts else None,
        "text_field": d.text_field if any(f.format in ("jsonl", "parquet") for f in train + held) else None,
    }, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:24]
    return CachePlan(train, held, spec, dtype, digest, os.path.join(root, digest))


@contextmanager
def _locked(path: str):
    """An exclusive lock on `path` (a second builder of the same cache waits); none where flock is missing."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX)
        except OSError:  # a file system without locks: the atomic rename still keeps the cache whole
            pass
        yield


def read_meta(cache_dir: str) -> dict | None:
    try:
        with open(os.path.join(cache_dir, "meta.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def prepare(cfg, progress: bool = True) -> dict:
    """Before launch: the cache of `cfg`'s files, built if missing (or rebuilt if its files are damaged), and every
    check of data against the config. Returns the cache's meta.json with the split (`split`)."""
    plan = plan_cache(cfg)
    meta, _ = _whole(plan.dir)
    if meta is None:
        root = os.path.dirname(plan.dir)
        try:
            os.makedirs(root, exist_ok=True)
            with _locked(plan.dir + ".lock"):
                meta, damage = _whole(plan.dir)  # built or repaired by another run while this one waited
                if meta is None:
                    if damage:  # its key says what it must hold: built again from the files
                        print(f"dtensor-moe train: token cache {plan.dir} is damaged ({damage}); rebuilding it",
                              file=sys.stderr)
                        shutil.rmtree(plan.dir)
                    meta = _build(plan, cfg, progress)
        except OSError as e:
            raise ValueError(f"the token cache cannot be written under data.cache_dir {root!r} "
                             f"({e.strerror or e}); valid: a writable directory with free space (free some, make "
                             "it writable, or set data.cache_dir or $DTENSOR_MOE_CACHE to another)") from None
    check_split(cfg, meta)
    return {**meta, "split": split(meta, cfg.data.eval_fraction)}


def _whole(cache_dir: str) -> tuple[dict | None, str | None]:
    """(its meta.json, None) for a whole cache; (None, what is wrong) for a damaged one; (None, None) for none."""
    meta = read_meta(cache_dir)
    if meta is None:
        return None, "no meta.json" if os.path.exists(cache_dir) else None
    damage = cache_damage(cache_dir, meta, full=True)
    return (None, damage) if damage else (meta, None)


def cache_damage(cache_dir: str, meta: dict, full: bool = False) -> str | None:
    """What is wrong with a cache's tokens.bin, or None: missing, or not the length meta.json records; with `full`,
    also its sha256, read whenever the file's mtime is not the one recorded at build (an edit in place)."""
    path = os.path.join(cache_dir, "tokens.bin")
    try:
        st = os.stat(path)
    except OSError:
        return "tokens.bin is missing"
    want = meta.get("tokens", 0) * array.array(DTYPES.get(meta.get("dtype"), "H")).itemsize
    if st.st_size != want:
        return f"tokens.bin holds {st.st_size:,} bytes, meta.json records {want:,}"
    if full and meta.get("sha256") and st.st_mtime_ns != meta.get("mtime_ns"):
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
        if h.hexdigest() != meta["sha256"]:
            return "tokens.bin's sha256 differs from meta.json's"
    return None


def _build(plan: CachePlan, cfg, progress: bool) -> dict:
    vocab_size = cfg.model.vocab_size
    texts = any(f.format != "tokens" for f in plan.files)
    tok = load_tokenizer(plan.tokenizer, cfg.model.hf_path) if texts else None
    if tok is not None and tok.vocab > vocab_size:
        what = "data.tokenizer" if plan.tokenizer != cfg.model.hf_path else "model.hf_path's tokenizer"
        raise ValueError(f"{what} {plan.tokenizer!r} has {tok.vocab:,} tokens, more than the model's embedding "
                         f"(model.vocab_size = {vocab_size:,}); valid: a tokenizer of at most {vocab_size:,} tokens, "
                         "or a model with a larger vocabulary")
    from tqdm import tqdm

    root = os.path.dirname(plan.dir)
    tmp = tempfile.mkdtemp(prefix=f".{plan.key}.", dir=root)
    code = DTYPES[plan.dtype]
    counts = {"train": [0, 0], "eval": [0, 0]}  # tokens, documents
    content = {"train": 0, "eval": 0}  # tokens that are not the end-of-text token joining documents
    digest = hashlib.sha256()
    max_id = -1
    # Held-out documents by content (data.eval_paths are read twice: they are the small part), so that a training
    # file holding one of them is refused, whatever the files are named.
    held_docs = {_doc_key(text) for f in plan.eval if f.format != "tokens"
                 for text, _ in documents(f, cfg.data.text_field)}
    try:
        # Shown after a second: a small cache, or bad data found at once, leaves no bar before its one line.
        bar = tqdm(total=sum(f.size for f in plan.files), unit="B", unit_scale=True, desc="tokenizing",
                   disable=not progress, file=sys.stderr, dynamic_ncols=True, delay=1.0)
        with open(os.path.join(tmp, "tokens.bin"), "wb") as out, _cleared_on_error(bar):
            for role, files in (("train", plan.train), ("eval", plan.eval)):
                for f in files:
                    if f.format == "tokens":
                        ids = token_shard(f, vocab_size)
                        for i in range(0, ids.size, 1 << 24):
                            chunk = ids[i:i + (1 << 24)].astype(plan.dtype).tobytes()
                            out.write(chunk)
                            digest.update(chunk)
                        counts[role][0] += int(ids.size)
                        content[role] += int(ids.size)
                        counts[role][1] += 1
                        max_id = max(max_id, int(ids.max()))
                        bar.update(f.size)
                        continue
                    seen = 0
                    for ids, n_docs, nbytes in _encoded(f, cfg.data.text_field, tok,
                                                        held_docs if role == "train" else None):
                        chunk = array.array(code, ids).tobytes()
                        out.write(chunk)
                        digest.update(chunk)
                        counts[role][0] += len(ids)
                        content[role] += len(ids) - n_docs
                        counts[role][1] += n_docs
                        max_id = max(max_id, max(ids))
                        bar.update(nbytes)
                        seen += nbytes
                    bar.update(f.size - seen)
        for role, files in (("train", plan.train), ("eval", plan.eval)):
            if files and not content[role]:
                field = f" (data.text_field {cfg.data.text_field!r})" if any(
                    f.format in ("jsonl", "parquet") for f in files) else ""
                raise ValueError(f"data.{'paths' if role == 'train' else 'eval_paths'} hold {counts[role][1]:,} "
                                 f"documents and every one is empty{field}: the model would {role} on end-of-text "
                                 "tokens alone; check the files and the field that holds their text")
        meta = {
            "version": VERSION, "dtype": plan.dtype, "tokens": counts["train"][0] + counts["eval"][0],
            "eval_start": counts["train"][0], "documents": {k: v[1] for k, v in counts.items()},
            "max_id": max_id, "tokenizer": plan.tokenizer, "tokenizer_vocab": tok.vocab if tok else None,
            "eot": tok.eot if tok else None,
            "files": {role: [f.path for f in files] for role, files in (("train", plan.train), ("eval", plan.eval))},
            "sha256": digest.hexdigest(), "mtime_ns": os.stat(os.path.join(tmp, "tokens.bin")).st_mtime_ns,
        }
        fsync_path(os.path.join(tmp, "tokens.bin"))
        write_atomic(os.path.join(tmp, "meta.json"), lambda f: f.write(json.dumps(meta, indent=1).encode()))
        try:
            os.rename(tmp, plan.dir)
            fsync_path(root)
        except OSError:
            if read_meta(plan.dir) is None:  # not a finished cache of another run: a real failure
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another run finished the same cache first
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta


@contextmanager
def _cleared_on_error(bar):
    """The progress bar, left on screen when the cache is built, erased when bad data stops the build."""
    try:
        yield bar
    except BaseException:
        bar.leave = False
        raise
    finally:
        bar.close()


def _doc_key(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()[:16]


def _encoded(f: DataFile, field: str, tok, held: set | None = None):
    """(token ids of a batch of documents, each followed by the end-of-text token; documents; bytes read). `held`:
    held-out documents' keys (`_doc_key`), none of which a training document may be."""
    batch, nbytes = [], 0

    def flush():
        ids = []
        for doc in tok.encode(batch):
            ids += doc
            ids.append(tok.eot)
        return ids, len(batch), nbytes

    for i, (text, n) in enumerate(documents(f, field)):
        if held and text.strip() and _doc_key(text) in held:
            raise ValueError(f"data.paths file {f.path!r} holds document {i + 1} ({text[:40]!r}...), which "
                             "data.eval_paths hold out too: held-out data must not be trained on; valid: remove it "
                             "from one of them")
        batch.append(text)
        nbytes += n
        if len(batch) == DOCS_PER_BATCH:
            yield flush()
            batch, nbytes = [], 0
    if batch:
        yield flush()


def split(meta: dict, eval_fraction: float) -> dict:
    """Token ranges [start, end) of the training and held-out parts: data.eval_paths' tokens, or the last
    eval_fraction of the stream (cut at a token: at most one document straddles it), or none held out."""
    n, start = meta["tokens"], meta["eval_start"]
    if start < n:
        return {"train": [0, start], "eval": [start, n]}
    if eval_fraction:
        cut = n - math.ceil(n * eval_fraction)
        return {"train": [0, cut], "eval": [cut, n]}
    return {"train": [0, n], "eval": None}


def check_split(cfg, meta: dict) -> None:
    """Enough tokens for one global batch and one held-out sequence; no id beyond the model's embedding."""
    d, m, t = cfg.data, cfg.model, cfg.training
    if meta["max_id"] >= m.vocab_size:
        raise ValueError(f"data.paths hold token id {meta['max_id']}, beyond the model's embedding "
                         f"(model.vocab_size = {m.vocab_size}); valid ids 0..{m.vocab_size - 1}")
    if meta.get("tokenizer_vocab") and meta["tokenizer_vocab"] > m.vocab_size:
        raise ValueError(f"data.tokenizer {meta['tokenizer']!r} has {meta['tokenizer_vocab']:,} tokens, more than "
                         f"the model's embedding (model.vocab_size = {m.vocab_size:,})")
    parts = split(meta, d.eval_fraction)
    n_train = parts["train"][1] - parts["train"][0]
    need = t.global_batch * t.seq_len + 1
    if n_train < need:
        held = (f" after data.eval_fraction = {d.eval_fraction} held {meta['tokens'] - n_train:,} out"
                if d.eval_fraction else "")
        raise ValueError(f"data.paths give {n_train:,} training tokens{held}, fewer than one global batch "
                         f"(training.global_batch {t.global_batch} x training.seq_len {t.seq_len} + 1 = {need:,}); "
                         "add data, or lower training.global_batch or training.seq_len")
    if parts["eval"] is not None and parts["eval"][1] - parts["eval"][0] < t.seq_len + 1:
        what = "data.eval_paths" if d.eval_paths else f"data.eval_fraction = {d.eval_fraction}"
        raise ValueError(f"{what} holds out {parts['eval'][1] - parts['eval'][0]:,} tokens, fewer than one sequence "
                         f"(training.seq_len {t.seq_len} + 1); hold out more, or lower training.seq_len")


def open_tokens(cfg):
    """On a rank: (training tokens, held-out tokens or None, meta) of `cfg`'s cache, memory-mapped (1-D tensors
    of the storage dtype). The launcher's `prepare` built it."""
    import mmap

    import torch

    plan = plan_cache(cfg)
    meta = read_meta(plan.dir)
    if meta is None:
        raise ValueError(f"the token cache {plan.dir} of data.paths is missing: the files changed after launch, or "
                         "this process did not run dtensor-moe train's checks; run dtensor-moe train again")
    damage = cache_damage(plan.dir, meta)
    if damage:
        raise ValueError(f"the token cache {plan.dir} is damaged ({damage}); run dtensor-moe train again (its "
                         "checks before launch rebuild it)")
    with open(os.path.join(plan.dir, "tokens.bin"), "rb") as f:
        # Copy-on-write: a writable buffer for torch (no warning), pages shared with the file until written (never).
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    tokens = torch.frombuffer(mm, dtype=getattr(torch, meta["dtype"]))
    parts = split(meta, cfg.data.eval_fraction)
    train = tokens[parts["train"][0]:parts["train"][1]]
    held = None if parts["eval"] is None else tokens[parts["eval"][0]:parts["eval"][1]]
    return train, held, {**meta, "split": parts, "cache": plan.dir}


def prefetcher(cache_dir: str, itemsize: int):
    """prefetch(starts, length): the kernel reads the training tokens [start, start + length) of each start into
    the page cache in the background (posix_fadvise WILLNEED; training tokens begin the file), so the step that
    maps them later finds them in memory. None where the platform has no posix_fadvise."""
    if not hasattr(os, "posix_fadvise"):
        return None
    fd = os.open(os.path.join(cache_dir, "tokens.bin"), os.O_RDONLY)

    def prefetch(starts, length: int) -> None:
        for start in starts.tolist():
            os.posix_fadvise(fd, start * itemsize, length * itemsize, os.POSIX_FADV_WILLNEED)

    return prefetch

