"""`dtensor-moe train` on the user's files (data.source = "files"): text, JSON lines and Parquet read with a
tokenizer the tests build (no network), packed, cached, evaluated on a held-out split; the same batches on every
mesh, an exact resume, and bad data refused in one line before any rank starts."""

import json
import math
import os
import random
import re
import threading
import time
from pathlib import Path

import pytest
import torch

from dtensor_moe.cli import main
from dtensor_moe.cli import train as train_cli
from dtensor_moe.titan_data.make import _sentence
from dtensor_moe.train import token_cache
from dtensor_moe.train.config import load_config
from dtensor_moe.train.data import PackedBatches, load_data, rank_batches
from dtensor_moe.train.loop import parallel_dims

from .harness import torchrun_on_ranks

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny_cpu.toml")
# One process, a small batch: each run trains in seconds. Sequences of 32 tokens, 8 per step.
SMALL = ["parallel.nproc=1", "parallel.ep=1", "parallel.etp=1", "training.seq_len=32", "training.global_batch=8",
         "training.warmup_steps=2"]

def _documents(n: int, seed: int = 0) -> list[str]:
    """Templated English-like documents (the torchtitan corpus's sentences): learnable, so the loss falls within a
    few steps."""
    rng = random.Random(seed)
    return [" ".join(_sentence(rng) for _ in range(rng.randrange(3, 9))) for _ in range(n)]


DOCS = _documents(240)


def _tokenizer(path: Path, docs: list[str], extra: int = 0) -> Path:
    """A word-level Hugging Face tokenizer of the documents' words (about 40 tokens, `extra` more), saved as
    save_pretrained writes it, with <eot> as its end-of-text token."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = sorted({w for d in docs for w in re.findall(r"\w+|[^\w\s]+", d)}) + [f"w{i}" for i in range(extra)]
    vocab = {"<unk>": 0, "<eot>": 1, **{w: i + 2 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eot>", unk_token="<unk>").save_pretrained(str(path))
    return path


def _write(tmp: Path, fmt: str, docs: list[str], name: str = "train") -> str:
    """The documents as `fmt` files under tmp; the glob that matches them."""
    if fmt == "jsonl":
        (tmp / f"{name}.jsonl").write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)))
        return str(tmp / f"{name}.jsonl")
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": docs, "id": list(range(len(docs)))}), tmp / f"{name}.parquet")
        return str(tmp / f"{name}.parquet")
    folder = tmp / name
    folder.mkdir()
    for i in range(0, len(docs), 20):  # a file per 20 documents, one document each
        (folder / f"{i:04d}.txt").write_text("\n".join(docs[i:i + 20]))
    return str(folder / "*.txt")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return _tokenizer(tmp_path_factory.mktemp("tok"), DOCS)


def _files(tmp_path, tok, paths, *more) -> list[str]:
    return ["data.source=files", f"data.paths={json.dumps(paths)}", f"data.tokenizer={tok}",
            f"data.cache_dir={tmp_path / 'cache'}", *more]


def _ranks_in_pools(monkeypatch):
    monkeypatch.setattr(train_cli, "_launch", lambda cmd, env, *_: torchrun_on_ranks(cmd, env))


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# --- training on each format -----------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["txt", "parquet"])
def test_each_format_trains_with_falling_loss_and_an_eval_loss(fmt, tmp_path, tok, capsys, monkeypatch):
    _ranks_in_pools(monkeypatch)
    run = tmp_path / "run"
    paths = [_write(tmp_path, fmt, DOCS)]
    argv = ["train", "--config", TINY, "--steps", "10", "--run-dir", str(run), *SMALL,
            *_files(tmp_path, tok, paths, "data.eval_fraction=0.1", "data.eval_every=5")]
    assert main(argv) == 0
    rows = _rows(run)
    assert [r["step"] for r in rows if "eval_loss" in r] == [5, 10]
    assert rows[-1]["loss"] < 0.6 * rows[0]["loss"], [r["loss"] for r in rows]
    assert rows[-1]["eval_loss"] < rows[4]["eval_loss"] < rows[0]["loss"]
    out = capsys.readouterr().out.splitlines()
    data = next(line for line in out if line.startswith("data "))
    files = "1 file, 240 documents" if fmt == "parquet" else "12 files, 12 documents"  # a text file is a document
    assert data.startswith(f"data     {files}: ") and data.endswith(f"; tokenizer {tok}"), data
    assert any(line.startswith(f"eval     {rows[-1]['eval_loss']:.4f} held-out loss after step 10") for line in out)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["eval"]["loss"] == rows[-1]["eval_loss"] and summary["data"]["source"] == "files"


def test_jsonl_on_ep2_etp2_matches_one_process(tmp_path, tok, capsys, monkeypatch):
    """4 ranks EP2 x ETP2 (4 data-parallel ranks) against the 1-process reference (--parity): the reference reads
    the same token cache, so every step's global batch is the same."""
    _ranks_in_pools(monkeypatch)
    run = tmp_path / "run"
    argv = ["train", "--config", TINY, "--steps", "6", "--run-dir", str(run), "--parity", *SMALL[3:],
            "parallel.nproc=4", "parallel.ep=2", "parallel.etp=2",
            *_files(tmp_path, tok, [_write(tmp_path, "jsonl", DOCS)], "data.eval_fraction=0.1", "data.eval_every=3")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "mesh     4 ranks on cpu: experts EDP1 x EP2 x ETP2" in out and ": pass" in out
    ours, ref = _rows(run), _rows(run / "reference_1proc")
    assert ours[-1]["loss"] < ours[0]["loss"]
    assert [r["step"] for r in ours if "eval_loss" in r] == [3, 6]
    assert max(abs(a["eval_loss"] - b["eval_loss"]) for a, b in zip(ours, ref) if "eval_loss" in a) <= 1e-4


def test_pipeline_evaluates_like_one_process(tmp_path, capsys, monkeypatch):
    """PP2 x EP2: the held-out loss comes from the last stage through the schedule's eval (Pipeline.evaluate);
    it equals the 1-process run's. The corpus source holds its tail out the same way (data.eval_fraction)."""
    _ranks_in_pools(monkeypatch)
    run = tmp_path / "run"
    assert main(["train", "--config", TINY, "--steps", "2", "--run-dir", str(run), "--parity", "parallel.nproc=4",
                 "parallel.pp=2", "parallel.ep=2", "parallel.etp=1", "data.eval_fraction=0.05",
                 "data.eval_every=1"]) == 0
    assert ": pass" in capsys.readouterr().out
    ours, ref = _rows(run), _rows(run / "reference_1proc")
    assert len([r for r in ours if "eval_loss" in r]) == 2
    assert all(abs(a["eval_loss"] - b["eval_loss"]) <= 1e-6 for a, b in zip(ours, ref))


def test_batches_equal_on_one_process_and_on_ep2_etp2(tmp_path, tok):
    """The ranks' shares of every step's batch (and of the held-out batches), put together, are bitwise the
    1-process batch: the same function the loop calls, on the mesh each rank computes."""
    base = ["training.seq_len=32", "training.global_batch=8", "parallel.microbatches=2",
            *_files(tmp_path, tok, [_write(tmp_path, "jsonl", DOCS)], "data.eval_fraction=0.2")]
    one = load_config(TINY, [*base, "parallel.nproc=1", "parallel.ep=1", "parallel.etp=1"])
    four = load_config(TINY, [*base, "parallel.nproc=4", "parallel.ep=2", "parallel.etp=2"])
    token_cache.prepare(one, progress=False)
    train, held, _ = load_data(one)
    whole, whole_eval = rank_batches(one, parallel_dims(one, 1), 0, train, held)
    dims = parallel_dims(four, 4)
    assert dims.dp_shard == 4 and dims.ep == 2 and dims.etp == 2
    parts = [rank_batches(four, dims, r, *load_data(four)[:2]) for r in range(4)]

    def joined(batches):  # each rank's rows are its slice of every microbatch
        return torch.cat([torch.cat([b.chunk(2)[m] for b in batches]) for m in range(2)])

    n_seq = whole.n_seq
    for step in (0, 1, n_seq // 8, n_seq // 8 + 1, 40):  # across an epoch boundary too
        for i in range(2):  # inputs, targets
            assert torch.equal(whole(step)[i], joined([p(step)[i] for p, _ in parts])), step
    for b, (x, y) in enumerate(whole_eval):
        assert torch.equal(x, joined([e(b)[0] for _, e in parts]))
        assert torch.equal(y, joined([e(b)[1] for _, e in parts]))


def test_an_epoch_reads_every_sequence_once(tmp_path):
    tokens = torch.arange(8 * 10 + 1)  # 10 sequences of 8
    batches = PackedBatches(tokens, 8, 5, 0, 0, 1)
    starts = torch.cat([batches.starts(s) for s in range(4)])  # two epochs
    assert sorted(starts[:10].tolist()) == sorted(starts[10:].tolist()) == list(range(0, 80, 8))
    assert starts[:10].tolist() != starts[10:].tolist()  # each epoch its own order
    x, y = batches(0)
    assert torch.equal(x[:, 1:], y[:, :-1]) and torch.equal(x[:, 0] % 8, torch.zeros(5, dtype=torch.long))


# --- exact resume ------------------------------------------------------------------------------------------


def test_resume_continues_the_exact_stream(tmp_path, tok, monkeypatch):
    """A run resumed from step 3 has the uninterrupted run's losses, bit for bit, also past an epoch boundary
    (about 3 steps an epoch here) and its evaluation."""
    _ranks_in_pools(monkeypatch)
    a, b = tmp_path / "a", tmp_path / "b"
    paths = [_write(tmp_path, "jsonl", DOCS[:40])]
    base = ["train", "--config", TINY, "--steps", "6", *SMALL[3:], "parallel.nproc=2", "parallel.ep=2",
            "parallel.etp=1", *_files(tmp_path, tok, paths, "data.eval_fraction=0.2", "data.eval_every=3")]
    assert main([*base, "--run-dir", str(a), "--checkpoint-every", "3"]) == 0
    assert main([*base, "--run-dir", str(b), "--resume", str(a / "checkpoints" / "step_00000003")]) == 0
    full, resumed = _rows(a), _rows(b)
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert [(r["loss"], r.get("eval_loss")) for r in resumed] == [(r["loss"], r.get("eval_loss")) for r in full[3:]]
    meta = token_cache.read_meta(token_cache.plan_cache(load_config(TINY, base[5:])).dir)
    n_seq = (meta["tokens"] - 1 - (meta["tokens"] - int(meta["tokens"] * 0.8))) // 32
    assert 6 * 8 > n_seq  # the run read more than an epoch


# --- the token cache ---------------------------------------------------------------------------------------


def _cfg(tmp_path, tok, paths, *more):
    return load_config(TINY, [*SMALL, *_files(tmp_path, tok, paths, *more)])


def test_formats_tokenize_alike_and_the_cache_is_reused(tmp_path, tok, monkeypatch):
    jsonl = _cfg(tmp_path, tok, [_write(tmp_path, "jsonl", DOCS)])
    parquet = _cfg(tmp_path, tok, [_write(tmp_path, "parquet", DOCS)])
    a, b = token_cache.prepare(jsonl, progress=False), token_cache.prepare(parquet, progress=False)
    plans = [token_cache.plan_cache(c) for c in (jsonl, parquet)]
    assert plans[0].dir != plans[1].dir and a["tokens"] == b["tokens"] and a["documents"] == b["documents"]
    blobs = [Path(p.dir, "tokens.bin").read_bytes() for p in plans]
    assert blobs[0] == blobs[1]
    ids = torch.frombuffer(bytearray(blobs[0]), dtype=torch.uint16).long()
    assert int((ids == 1).sum()) == len(DOCS) and int(ids[-1]) == 1  # every document ends with <eot>

    def no_build(*args):
        raise AssertionError("rebuilt a cache that exists")

    monkeypatch.setattr(token_cache, "_build", no_build)
    assert token_cache.prepare(jsonl, progress=False)["tokens"] == a["tokens"]  # reused
    monkeypatch.undo()
    with open(jsonl.data.paths[0], "a") as f:  # new content: a new cache
        f.write(json.dumps({"text": "one more document."}) + "\n")
    assert token_cache.plan_cache(jsonl).dir != plans[0].dir
    assert token_cache.prepare(jsonl, progress=False)["documents"]["train"] == len(DOCS) + 1


def test_the_cache_follows_content_not_names(tmp_path, tok):
    """Invariants of the key: a file edited in place with its size and mtime kept (cp -p, rsync -t) and a tokenizer
    rewritten in its directory each key a new cache; the same content keys the same one."""
    path = _write(tmp_path, "jsonl", DOCS)
    tok_dir = tmp_path / "tok"
    _tokenizer(tok_dir, DOCS)
    cfg = _cfg(tmp_path, tok_dir, [path])
    first = token_cache.plan_cache(cfg).dir
    assert token_cache.plan_cache(cfg).dir == first
    st = os.stat(path)
    data = Path(path).read_bytes()
    Path(path).write_bytes(data.replace(b"the", b"tha", 1))  # same size
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # same mtime, as cp -p / rsync -t keep it
    assert os.stat(path).st_size == st.st_size and os.stat(path).st_mtime_ns == st.st_mtime_ns
    edited = token_cache.plan_cache(cfg).dir
    assert edited != first
    Path(path).write_bytes(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert token_cache.plan_cache(cfg).dir == first  # its content again: its cache again
    _tokenizer(tok_dir, DOCS, extra=3)  # retrained into the same directory
    assert token_cache.plan_cache(cfg).dir not in (first, edited)


def test_cache_damage_is_rebuilt_or_refused(tmp_path, tok, capsys):
    """A truncated, corrupted or missing tokens.bin, or a cache without meta.json, is rebuilt before launch (one
    line says so) and refused on a rank in one line."""
    cfg = _cfg(tmp_path, tok, [_write(tmp_path, "jsonl", DOCS)])
    meta = token_cache.prepare(cfg, progress=False)
    cache = Path(token_cache.plan_cache(cfg).dir)
    good = (cache / "tokens.bin").read_bytes()
    damages = {
        "truncated": lambda: (cache / "tokens.bin").write_bytes(good[:-2]),
        "corrupted": lambda: (cache / "tokens.bin").write_bytes(bytes([good[0] ^ 1]) + good[1:]),
        "no meta.json": lambda: (cache / "meta.json").unlink(),
    }
    damage_found = {"truncated": "tokens.bin holds", "corrupted": "tokens.bin's sha256 differs from meta.json's",
                    "no meta.json": "no meta.json"}
    for name, damage in damages.items():
        damage()
        if name != "no meta.json":
            assert token_cache.cache_damage(str(cache), meta, full=True), name
        if name == "truncated":
            with pytest.raises(ValueError, match=r"the token cache .* is damaged \(tokens.bin holds .* bytes, "
                                                 r"meta.json records .*\); run dtensor-moe train again"):
                token_cache.open_tokens(cfg)
        rebuilt = token_cache.prepare(cfg, progress=False)
        assert (cache / "tokens.bin").read_bytes() == good and rebuilt["tokens"] == meta["tokens"], name
        note = capsys.readouterr().err
        assert f"is damaged ({damage_found[name]}" in note, note
        assert not token_cache.cache_damage(str(cache), rebuilt, True)


@pytest.mark.parametrize("signum", [2, 15, 1], ids=["SIGINT", "SIGTERM", "SIGHUP"])
def test_a_signal_while_tokenizing_leaves_nothing(tmp_path, tok, capsys, monkeypatch, signum):
    """Ctrl-C, SIGTERM or SIGHUP in the middle of the cache build: exit 128 + N with one line, no traceback, and
    no temporary directory left in the cache root (the next run builds the cache whole)."""
    import signal

    encoded = token_cache._encoded

    def signalled(*args):
        for i, chunk in enumerate(encoded(*args)):
            if i == 0:
                os.kill(os.getpid(), signum)
            yield chunk

    monkeypatch.setattr(token_cache, "DOCS_PER_BATCH", 8)  # several batches: the signal lands mid-build
    monkeypatch.setattr(token_cache, "_encoded", signalled)
    argv = ["train", "--config", TINY, "--run-dir", str(tmp_path / "run"), *SMALL,
            *_files(tmp_path, tok, [_write(tmp_path, "jsonl", DOCS)])]
    assert main(argv) == 128 + signum
    err = capsys.readouterr().err
    name = signal.Signals(signum).name
    assert err.splitlines()[-1] == ("dtensor-moe train: interrupted (Ctrl-C); its temporary files were removed"
                                    if name == "SIGINT" else
                                    f"dtensor-moe train: stopped by {name}; its temporary files were removed"), err
    assert "Traceback" not in err
    assert sorted(p.name for p in (tmp_path / "cache").iterdir() if p.is_dir()) == []


def test_an_unwritable_cache_dir_is_one_line(tmp_path, tok, monkeypatch):
    """A cache directory that cannot be made (under a file) or a full disk: a ValueError naming data.cache_dir and
    the OS's reason, not an OSError traceback."""
    path = _write(tmp_path, "jsonl", DOCS)
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ValueError, match=r"the token cache cannot be written under data.cache_dir '.*a_file/cache'"):
        token_cache.prepare(_cfg(tmp_path / "a_file", tok, [path]), progress=False)  # its cache_dir: a_file/cache

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(token_cache.tempfile, "mkdtemp", full)
    with pytest.raises(ValueError, match=r"cannot be written under data.cache_dir .* \(No space left on device\); "
                                         r"valid: a writable directory with free space"):
        token_cache.prepare(_cfg(tmp_path, tok, [path]), progress=False)


def test_held_out_by_content_and_empty_documents_are_refused(tmp_path, tok):
    """An eval file with a training file's content (another name), a training file holding one of the held-out
    documents, and a corpus of empty documents, each refused before any token is cached."""
    train = _write(tmp_path, "jsonl", DOCS)
    twin = tmp_path / "heldout.jsonl"
    twin.write_bytes(Path(train).read_bytes())
    with pytest.raises(ValueError, match=r"data.eval_paths file .*heldout.jsonl' has the content of data.paths file "
                                         r".*train.jsonl' \(the same sha256\): held-out data must not be trained on"):
        token_cache.prepare(_cfg(tmp_path, tok, [train], f"data.eval_paths={json.dumps([str(twin)])}"), progress=False)
    shared = _write(tmp_path, "jsonl", DOCS[:50] + ["a document held out and trained on."], "mixed")
    held = tmp_path / "held.jsonl"
    held.write_text(json.dumps({"text": "another held-out document."}) + "\n"
                    + json.dumps({"text": "a document held out and trained on."}) + "\n")
    with pytest.raises(ValueError, match=r"data.paths file .*mixed.jsonl' holds document 51 \('a document held out "
                                         r"and trained on.'\.\.\.\), which data.eval_paths hold out too"):
        token_cache.prepare(_cfg(tmp_path, tok, [shared], f"data.eval_paths={json.dumps([str(held)])}"),
                            progress=False)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("".join(json.dumps({"text": ""}) + "\n" for _ in range(50)))
    with pytest.raises(ValueError, match=r"data.paths hold 50 documents and every one is empty \(data.text_field "
                                         r"'text'\): the model would train on end-of-text tokens alone"):
        token_cache.prepare(_cfg(tmp_path, tok, [str(empty)]), progress=False)
    assert not [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]  # nothing cached, no temporary left


def test_byte_tokenizer_and_token_shards(tmp_path):
    import numpy as np

    (tmp_path / "a.txt").write_text("héllo")
    np.save(tmp_path / "b.npy", np.array([7, 8, 9], dtype=np.int64))
    cfg = load_config(TINY, ["data.source=files", f'data.paths=["{tmp_path}/a.txt", "{tmp_path}/b.npy"]',
                             f"data.cache_dir={tmp_path / 'cache'}", "training.seq_len=2", "training.global_batch=1"])
    assert cfg.data.resolved_tokenizer("") == "byte"
    token_cache.prepare(cfg, progress=False)
    train, held, info = load_data(cfg)
    assert held is None and info["train_tokens"] == 10
    assert train.long().tolist() == [*"héllo".encode(), 0, 7, 8, 9]  # byte 0 ends a text document


def test_two_runs_building_one_cache_at_once(tmp_path, tok):
    """Both get the same cache, tokenized once (the second waits on the lock), and no temporary files remain."""
    cfg = _cfg(tmp_path, tok, [_write(tmp_path, "jsonl", DOCS)])
    builds, results = [], []
    real_build = token_cache._build

    def slow_build(*args):
        builds.append(1)
        time.sleep(0.3)
        return real_build(*args)

    token_cache._build = slow_build
    try:
        threads = [threading.Thread(target=lambda: results.append(token_cache.prepare(cfg, progress=False)))
                   for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        token_cache._build = real_build
    assert len(builds) == 1 and len(results) == 2 and results[0]["tokens"] == results[1]["tokens"]
    # A builder that loses the race to an already finished cache (no lock: another machine) keeps the winner's.
    plan = token_cache.plan_cache(cfg)
    before = Path(plan.dir, "tokens.bin").stat().st_mtime_ns
    assert real_build(plan, cfg, False)["tokens"] == results[0]["tokens"]
    assert Path(plan.dir, "tokens.bin").stat().st_mtime_ns == before
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == sorted(
        [plan.key, plan.key + ".lock", "digests.json"])


# --- bad input: one line, rc 2, before any rank starts -----------------------------------------------------


def _tokens(tmp: Path, tok: Path, paths: list[str]) -> int:
    """Tokens of the files' cache (documents and their end-of-text tokens)."""
    cfg = load_config(TINY, [*SMALL[:3], "training.seq_len=4", "training.global_batch=1", *_files(tmp, tok, paths)])
    return token_cache.prepare(cfg, progress=False)["tokens"]


def _bad_inputs(tmp: Path, tok: Path) -> list[tuple[list[str], str]]:
    jsonl = _write(tmp, "jsonl", DOCS[:4], "few")
    (tmp / "empty.jsonl").write_text("")
    (tmp / "notes.csv").write_text("a,b\n")
    (tmp / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp / "broken.jsonl").write_text('{"text": "fine"}\n{"text": \n')
    os.symlink(tmp / "gone.jsonl", tmp / "dangling.jsonl")
    (tmp / "no_tok").mkdir()
    big = _tokenizer(tmp / "big_tok", DOCS, extra=300)
    main_data = _write(tmp, "jsonl", DOCS)
    parquet = _write(tmp, "parquet", DOCS[:4], "few")
    few, n = _tokens(tmp, tok, [jsonl]), _tokens(tmp, tok, [main_data])
    vocab = 2 + len({w for d in DOCS for w in re.findall(r"\w+|[^\w\s]+", d)}) + 300

    def files(paths, *more, tokenizer=tok):
        return _files(tmp, tokenizer, paths, *more)

    return [
        (files([str(tmp / "nothing" / "*.jsonl")]), f"data.paths pattern '{tmp}/nothing/*.jsonl' matches no file"),
        (files([str(tmp / "notes.csv")]), f"data.paths: '{tmp}/notes.csv' has an unknown extension '.csv'; valid: "
                                          ".txt, .text, .md, .jsonl, .parquet, .npy"),
        (files([str(tmp / "empty.jsonl")]), f"data.paths: '{tmp}/empty.jsonl' is empty"),
        (files([str(tmp / "dangling.jsonl")]), f"data.paths: '{tmp}/dangling.jsonl' cannot be read (No such file"),
        (files([str(tmp / "latin1.txt")]), f"data.paths: '{tmp}/latin1.txt' is not UTF-8 text"),
        (files([str(tmp / "broken.jsonl")]), f"data.paths: {tmp}/broken.jsonl:2 is not a JSON object"),
        (files([jsonl], "data.text_field=body"), f"data.text_field 'body' is missing at {jsonl}:1 (its fields: "
                                                 "['id', 'text'])"),
        (files([parquet], "data.text_field=body"), f"data.text_field 'body' is not a column of '{parquet}' (its "
                                                   "columns: ['text', 'id'])"),
        (files([main_data], tokenizer=big), f"data.tokenizer '{big}' has {vocab} tokens, more than the model's "
                                            "embedding (model.vocab_size = 256)"),
        (files([main_data], tokenizer=tmp / "no_tok"), f"data.tokenizer '{tmp}/no_tok' holds no tokenizer files"),
        (["data.source=files", f'data.paths=["{main_data}"]', "model.vocab_size=1000"],
         "data.tokenizer is needed for model.vocab_size (1000) > 256"),
        (files([jsonl]), f"data.paths give {few} training tokens, fewer than one global batch (training.global_batch 8 "
                         "x training.seq_len 32 + 1 = 257)"),
        (files([main_data], "data.eval_fraction=1.0"), "data.eval_fraction (1.0) must be < 1: the held-out split "
                                                       "would leave no training data"),
        (files([main_data], "data.eval_fraction=0.99"), f"data.paths give {n - math.ceil(n * 0.99)} training "
                                                        f"tokens after data.eval_fraction = 0.99 held "
                                                        f"{math.ceil(n * 0.99):,} out, fewer than one "
                                                        "global batch"),
        (files([main_data], "data.eval_fraction=0.001"), f"data.eval_fraction = 0.001 holds out "
                                                         f"{math.ceil(n * 0.001)} tokens, fewer than one sequence "
                                                         "(training.seq_len 32 + 1)"),
        (files([main_data], f'data.eval_paths=["{main_data}"]'), "data.eval_paths and data.paths both match"),
        (files([main_data], "data.eval_every=5"), "data.eval_every (5) needs a held-out split"),
        ([f'data.paths=["{main_data}"]'], "data.paths is read only with data.source = 'files', got data.source = "
                                          "'corpus'"),
        (["data.source=files"], "data.source = 'files' needs data.paths"),
    ]


def test_bad_data_is_refused_before_launch_in_one_line(tmp_path, tok, capsys, monkeypatch):
    launched = []
    monkeypatch.setattr(train_cli, "_launch", lambda *a: launched.append(a) or 0)
    for argv, message in _bad_inputs(tmp_path, tok):
        run = tmp_path / "run"
        assert main(["train", "--config", TINY, "--run-dir", str(run), *SMALL, *argv]) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith(f"dtensor-moe train: {message}") and err.count("\n") == 1, (message, err)
        assert not run.exists()
    assert not launched


def test_parquet_without_pyarrow_is_refused_with_an_install_hint(tmp_path, tok, capsys, monkeypatch):
    import importlib.util

    parquet = _write(tmp_path, "parquet", DOCS)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "pyarrow" else find_spec(name, *a))
    assert main(["train", "--config", TINY, "--run-dir", str(tmp_path / "run"), *SMALL,
                 *_files(tmp_path, tok, [parquet])]) == 2
    assert capsys.readouterr().err == (f"dtensor-moe train: data.paths: reading Parquet ('{parquet}') needs pyarrow: "
                                       "pip install pyarrow (or pip install 'dtensor_moe[data]')\n")


def test_data_read_benchmark_runs(tmp_path):
    """benchmarks/data_read.py's code paths at a tiny size (nothing timed is checked)."""
    from benchmarks import data_read

    out = tmp_path / "data_read.json"
    assert data_read.main(["--tokens", "20000", "--steps", "3", "--paced-steps", "3", "--ranks", "1", "2",
                           "--seq-len", "64", "--global-batch", "4", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["dtype"], r["ranks"]) for r in rows] == [("uint16", 1), ("uint16", 2), ("int32", 1), ("int32", 2)]
    assert all(v > 0 for r in rows for v in r["tokens_per_s_per_rank"].values())
