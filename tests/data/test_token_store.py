"""Tokenize once: the token store against the tokenizer itself, and its cache (key, lock, reuse, failures)."""
import gc
import json
import logging
import multiprocessing
import os

import numpy as np
import pytest

from infjax.benchmarks.shapes import inf_ir_shaped_records, write_byte_bpe_tokenizer
from infjax.data import batches, pipeline, synthetic, token_store
from infjax.data.tokenize import TextFormat, Tokenizer
from tests.helpers.configs import changed, small_config
from tests.helpers.runs import data_fingerprint
from tests.helpers.tiny import tiny_bert_path

# Texts a byte-level BPE splits in many ways: accents, digits, punctuation runs, emoji, several spaces.
ODD = ["Résumé of café 1999 -- très bien!!", "3.14159 apples,, 42nd   street", "naïve façade 🙂 x2",
       "what's \"quoted\" (here)?", "Ünïcödé, 中文 and 日本語"]


def _records(n=40):
    records = inf_ir_shaped_records(n, seed=4)
    for i, r in enumerate(records[:len(ODD)]):
        r["query_positive"] = ODD[i]
        r["instruction_negative"] = ODD[(i + 1) % len(ODD)] + " instead"
        r["document_positive"] = ODD[(i + 2) % len(ODD)] + " " + r["document_positive"]
    return records


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """WordPiece with [CLS]/[SEP] (MiniLM's), byte-level BPE without special tokens (Qwen2's kind), and the same
    BPE adding a BOS token in front (Llama's kind)."""
    root = tmp_path_factory.mktemp("tokenizers")
    bpe = str(root / "bpe")
    write_byte_bpe_tokenizer(bpe)
    bos = str(root / "bpe_bos")
    os.makedirs(bos)
    for name in os.listdir(bpe):
        with open(os.path.join(bpe, name), "rb") as src, open(os.path.join(bos, name), "wb") as dst:
            dst.write(src.read())
    with open(os.path.join(bos, "tokenizer.json"), encoding="utf-8") as f:
        spec = json.load(f)
    special = "<|endoftext|>"
    spec["post_processor"] = {"type": "TemplateProcessing",
                              "single": [{"SpecialToken": {"id": special, "type_id": 0}},
                                         {"Sequence": {"id": "A", "type_id": 0}}],
                              "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                              "special_tokens": {special: {"id": special, "ids": [spec["added_tokens"][0]["id"]],
                                                           "tokens": [special]}}}
    with open(os.path.join(bos, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(spec, f)
    return {"wordpiece": tiny_bert_path(), "bpe": bpe, "bpe_bos": bos}


def _step_texts(store, records, path, fmt, interaction="concat", k=3):
    plan = batches.BatchPlan(len(store), 8, seed=1)
    sampler = None if interaction == "cross_attention" else batches.InstructionNegativeSampler(len(store.pool), k, 1)
    meta = store.meta["encoding"]
    return batches.StepTexts(store, plan, meta["query_max_len"], meta["passage_max_len"], True, sampler,
                             interaction=interaction, texts=batches.Texts(records, Tokenizer(path), fmt))


FORMATS = [("default", TextFormat(), "concat"),
           ("e5 prefixes, instruction first", TextFormat("{instruction} {query}", "query: ", "passage: "), "concat"),
           ("constants around and between", TextFormat("Instruct: {instruction}\nQuery: {query} .", "", ""), "concat"),
           ("interaction II", TextFormat("{query} {instruction}", "query: ", "passage: "), "cross_attention")]


@pytest.mark.parametrize("kind", ["wordpiece", "bpe", "bpe_bos"])
@pytest.mark.parametrize("name,fmt,interaction", FORMATS, ids=[f[0] for f in FORMATS])
def test_assembled_ids_are_the_tokenizers_ids_of_the_whole_texts(tokenizers, kind, name, fmt, interaction):
    """Every side of a step, assembled from the store's pieces, equals what the tokenizer makes of the step's
    texts (special tokens, template constants, cuts at max length on both sides); the cut flags equal the
    tokenizer's uncut lengths over max length."""
    path = tokenizers[kind]
    records = _records()
    store = token_store.in_memory(records, path, token_store.Encoding(24, 40, fmt, interaction))
    assert store.exact, store.meta["mismatch_example"]
    build = _step_texts(store, records, path, fmt, interaction)
    tokenizer = build.texts.tokenizer
    cut_seen = 0
    for step in range(3):
        sides, groups = build.side_ids(step)
        texts, text_groups = build.side_texts(step)
        assert set(sides) == set(texts)
        for side, v in sides.items():
            want = tokenizer.tokens(texts[side], build.max_len(side))
            got = np.split(v.flat, np.cumsum(v.lengths)[:-1]) if len(v.lengths) else []
            assert [g.tolist() for g in got] == [w.tolist() for w in want], side
            cut = np.array(tokenizer.lengths(texts[side])) > build.max_len(side)
            np.testing.assert_array_equal(v.cut, cut)
            cut_seen += int(cut.sum())
        if interaction == "cross_attention":
            np.testing.assert_array_equal(groups, text_groups)
    assert cut_seen > 0                                   # the lengths cut texts on some side


def test_a_template_the_tokenizer_does_not_split_at_its_fields_is_tokenized_each_step(tokenizers, caplog):
    """Byte-level BPE reads "what?Find" unlike "what?" + "Find": the store says it cannot assemble the queries
    (one warning naming an example), and the batches are then the tokenizer's own, by per-step tokenization."""
    path = tokenizers["bpe"]
    records = _records()
    fmt = TextFormat("{query}{instruction}")
    config = changed(small_config(), **{"data.query_template": "{query}{instruction}", "data.query_max_len": 24,
                                        "data.passage_max_len": 40})
    with caplog.at_level(logging.WARNING):
        data = pipeline.open_training_data(config, path, records=records)
    assert not data.store.exact and data.store.meta["mismatch"] > 0
    assert "cannot be assembled from their fields' ids" in caplog.text and "the tokenizer gives" in caplog.text
    build = _step_texts(data.store, list(data.records), path, fmt)
    texts, _ = build.side_texts(2)
    sides, _ = build.side_ids(2)
    for side, v in sides.items():
        want = build.texts.tokenizer.tokens(texts[side], build.max_len(side))
        assert np.concatenate(want).tolist() == v.flat.tolist()


def test_packed_and_padded_batches_equal_those_of_the_tokenized_texts(tokenizers):
    """The whole batch (packed over 4 shards; padded on the right and on the left) from the store equals the one
    built by per-step tokenization, from each step's texts through the tokenizer."""
    import dataclasses

    from infjax.data import packing

    path = tokenizers["bpe_bos"]
    records = _records()
    fmt = TextFormat()
    store = token_store.in_memory(records, path, token_store.Encoding(24, 40, fmt))
    per_step = dataclasses.replace(store, meta={**store.meta, "exact": False})   # the same data, tokenized per step
    new_t, old_t = _step_texts(store, records, path, fmt), _step_texts(per_step, records, path, fmt)
    for side_pad in ("right", "left"):
        new_b = batches.BatchBuilder(new_t, padding_side=side_pad)
        old_b = batches.BatchBuilder(old_t, padding_side=side_pad)
        for step in range(3):
            a, b = new_b(step), old_b(step)
            assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    packed = batches.Packing(batches.measure_shapes(new_t, range(3), 4, pack_lengths={"query": 48, "passage": 48}),
                             shards=4)
    new_b, old_b = batches.BatchBuilder(new_t, packed), batches.BatchBuilder(old_t, packed)
    for step in range(3):
        a, b = new_b(step), old_b(step)
        for side in a:
            for key in packing.KEYS:
                np.testing.assert_array_equal(a[side][key], b[side][key])


# --------------------------------------------------------------------------
# The cache
# --------------------------------------------------------------------------

def _write(path, records, extra=None):
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(dict(r, **(extra or {}))) + "\n")
    return str(path)


def _config(source, cache, **overrides):
    return changed(small_config(), **{"data.source": str(source), "data.cache_dir": str(cache),
                                      "data.query_max_len": 32, "data.passage_max_len": 48, **overrides})


def _open(config):
    return pipeline.open_training_data(config, tiny_bert_path())


def _arrays(store):
    """The store's arrays, copied out of their memory maps."""
    return {k: np.array(getattr(store, k)) for k in ("tokens", "offset", "length", "uncut", "source", "kept",
                                                         "pool", "own")}


def test_the_cache_is_built_once_reused_and_keyed_by_content(tmp_path, caplog):
    """A second open reads the cache (no tokenizing); a file rewritten in place with the same size and date but
    other bytes, another max length, or another template each make another cache entry; the cached store equals
    one tokenized in memory."""
    records = _records(30)
    data_file = tmp_path / "msmarco.jsonl"
    _write(data_file, records)
    cache = tmp_path / "cache"
    with caplog.at_level(logging.INFO, logger="infjax.data"):
        first = _open(_config(data_file, cache)).store
    assert "tokenizing 30 rows" in caplog.text and first.folder.startswith(str(cache))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="infjax.data"):
        again = _open(_config(data_file, cache)).store
    assert "tokenizing" not in caplog.text and again.folder == first.folder
    memory = token_store.in_memory(records, tiny_bert_path(), token_store.Encoding(32, 48))
    for k, v in _arrays(memory).items():
        np.testing.assert_array_equal(_arrays(again)[k], v, err_msg=k)
    assert again.fingerprint == memory.fingerprint
    stat = os.stat(data_file)
    swapped = records[1:2] + records[:1] + records[2:]                     # same bytes, other order
    _write(data_file, swapped)
    os.utime(data_file, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert os.path.getsize(data_file) == stat.st_size
    folders = {first.folder}
    for config in (_config(data_file, cache), _config(data_file, cache, **{"data.passage_max_len": 64}),
                   _config(data_file, cache, **{"data.query_template": "{instruction} {query}"})):
        store = _open(config).store
        assert store.folder not in folders
        folders.add(store.folder)
    assert sorted(os.listdir(cache / "tokens")) == sorted([os.path.basename(f) for f in folders] +
                                                          [os.path.basename(f) + ".lock" for f in folders])


def test_bad_rows_and_duplicates_are_said_on_every_run_from_the_cache_too(tmp_path, caplog):
    records = _records(12)
    bad = dict(records[3], query_negative=records[3]["query_positive"])    # a negative equal to its positive
    rows = records + [bad, records[5]]                                      # and a duplicate of record 5
    data_file = _write(tmp_path / "msmarco.jsonl", rows)
    config = _config(data_file, tmp_path / "cache", **{"data.on_bad_row": "skip"})
    for _ in range(2):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            data = _open(config)
        assert "skipped 1 bad row(s): (row 12, 'query_negative'" in caplog.text
        assert "1 duplicate record(s) dropped (data.dedupe=True): record 12 repeats record 5" in caplog.text
        assert len(data.store) == 12 and data.records[5]["document_positive"] == records[5]["document_positive"].strip()


def test_a_failed_build_leaves_no_cache_and_the_fixed_data_builds(tmp_path):
    """A bad row (on_bad_row=error) stops the build naming its row; nothing of it is left in the cache (no
    folder, no temporary one), and the data, fixed, builds."""
    from infjax.data.inf_ir import BadRowError

    records = _records(10)
    rows = records + [dict(records[0], instruction_positive="   ")]
    data_file = _write(tmp_path / "msmarco.jsonl", rows)
    cache = tmp_path / "cache"
    with pytest.raises(BadRowError, match=r"row 10, field 'instruction_positive'"):
        _open(_config(data_file, cache))
    assert [n for n in os.listdir(cache / "tokens") if not n.endswith(".lock")] == []
    _write(data_file, records)
    assert len(_open(_config(data_file, cache)).store) == 10


def test_a_damaged_cache_entry_is_said_and_built_again(tmp_path, caplog):
    """A cache entry whose ids file was cut (a full disk, a copy stopped halfway) is not read: one warning says
    what is wrong, and the entry is tokenized again, equal to the first."""
    data_file = _write(tmp_path / "msmarco.jsonl", _records(10))
    config = _config(data_file, tmp_path / "cache")
    store = _open(config).store
    first, folder = _arrays(store), store.folder
    del store                                  # no map of the file is left to read past its new end
    gc.collect()
    size = os.path.getsize(os.path.join(folder, "tokens.bin"))
    os.truncate(os.path.join(folder, "tokens.bin"), size // 2)
    with caplog.at_level(logging.WARNING):
        again = _open(config).store
    assert f"token cache {folder} is damaged (tokens.bin has {size // 2} bytes, meta.json says {size})" in caplog.text
    for k, v in first.items():
        np.testing.assert_array_equal(_arrays(again)[k], v, err_msg=k)


def test_an_object_store_cache_dir_is_refused_before_anything_is_read():
    from infjax import config as config_lib

    config = small_config(**{"data.cache_dir": "gs://bucket/cache"})
    with pytest.raises(config_lib.ConfigError, match=r"config.data.cache_dir='gs://bucket/cache': must be a local"):
        config_lib.validate(config, 8)


def _open_in_child(args):
    source, cache, out = args
    logging.basicConfig(level=logging.INFO, filename=out, filemode="w", force=True)
    store = _open(_config(source, cache)).store
    return store.folder, int(np.asarray(store.tokens).sum())


def test_processes_that_start_together_build_one_cache_and_agree(tmp_path):
    """Two processes opening one data set at once: one tokenizes, the other waits for it and reads the same
    folder; worker processes tokenize the same ids as this process."""
    records = _records(60)
    data_file = _write(tmp_path / "msmarco.jsonl", records)
    cache = tmp_path / "cache"
    ctx = multiprocessing.get_context("spawn")
    logs = [str(tmp_path / f"log{i}") for i in range(2)]
    with ctx.Pool(2) as pool:
        results = pool.map(_open_in_child, [(data_file, str(cache), log) for log in logs])
    assert results[0] == results[1]
    texts = [open(log).read() for log in logs]
    assert sum("tokenizing 60 rows" in t for t in texts) == 1
    job = token_store.Job([("msmarco", _dataset(records), dict(token_store.inf_ir.DEFAULT_FIELD_MAP))],
                          tiny_bert_path(), "right", token_store.Encoding(32, 48), chunk_rows=16)
    in_workers = token_store.build(job, token_store.Reading(), {}, None, workers=2)
    here = token_store.build(job, token_store.Reading(), {}, None, workers=0)
    for k, v in _arrays(here).items():
        np.testing.assert_array_equal(_arrays(in_workers)[k], v, err_msg=k)


def _dataset(records):
    import datasets

    return datasets.Dataset.from_dict({k: [r[k] for r in records] for k in records[0]})


def test_fingerprint_sees_order_and_content():
    records = synthetic.make_train_records(5, seed=1)
    fp = data_fingerprint(records)
    assert fp == data_fingerprint([dict(r) for r in records]) and fp["records"] == 5
    assert data_fingerprint(records[::-1])["hash"] != fp["hash"]
    changed = [dict(r) for r in records]
    changed[2]["query_positive"] += "!"
    assert data_fingerprint(changed)["hash"] != fp["hash"]


def test_a_waiting_process_says_who_holds_the_cache_when_it_starts_waiting_then_once_per_interval(
        tmp_path, caplog, monkeypatch):
    """A process waiting for another's cache build logs the holder at once, then every SAY_EVERY seconds, however
    often it tries the lock (scaled down here: tries every 20 ms, a line every 0.5 s, held 1.2 s: 3 lines)."""
    import threading

    monkeypatch.setattr(token_store.BuildLock, "POLL", 0.02)
    monkeypatch.setattr(token_store.BuildLock, "SAY_EVERY", 0.5)
    path = str(tmp_path / "tokens" / "k.lock")
    holder = token_store.BuildLock(path).__enter__()
    release = threading.Timer(1.2, holder.__exit__, (None, None, None))
    release.start()
    with caplog.at_level(logging.INFO, logger="infjax"), token_store.BuildLock(path):
        pass
    release.join()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("waiting for another process")]
    assert 2 <= len(lines) <= 4, lines                  # 0, 0.5 and 1.0 s; not one per try (about 60)
    assert all(f'"pid": {os.getpid()}' in line and str(tmp_path / "tokens" / "k") in line for line in lines), lines


def _built(tmp_path, n=10):
    data_file = _write(tmp_path / "msmarco.jsonl", _records(n))
    config = _config(data_file, tmp_path / "cache")
    store = _open(config).store
    first, folder = _arrays(store), store.folder
    del store                                  # no map of the files is left
    gc.collect()
    return config, first, folder


def _flip(path, start, count):
    data = bytearray(open(path, "rb").read())
    for i in range(start, start + count):
        data[i] ^= 0xFF
    open(path, "wb").write(bytes(data))


def _rotate_ids(path):
    ids = np.fromfile(path, np.uint16)
    np.roll(ids, 1).tofile(path)


def _move_counts(path):
    length = np.load(path)
    length[0, 0], length[0, 1] = length[0, 1], length[0, 0] + 1      # row 0's counts moved, its sum kept + 1
    length[1, 0] -= 1
    np.save(path, length)


DAMAGE = {"640 bytes of tokens.bin flipped": ("tokens.bin", lambda p: _flip(p, 0, 640)),
          "tokens.bin's ids rotated by one": ("tokens.bin", _rotate_ids),
          "counts moved inside length.npy": ("length.npy", _move_counts),
          "64 bytes of offset.npy flipped": ("offset.npy", lambda p: _flip(p, os.path.getsize(p) - 64, 64))}


@pytest.mark.parametrize("damage", DAMAGE)
def test_an_entry_whose_bytes_changed_but_not_its_sizes_is_said_and_built_again(tmp_path, caplog, damage):
    """A file of a cache entry changed in place, its size kept (bytes flipped, ids rotated, counts moved):
    one warning names the file, and the entry is tokenized again, equal to the first, so no step trains on
    the changed ids."""
    name, change = DAMAGE[damage]
    config, first, folder = _built(tmp_path, n=40)
    path = os.path.join(folder, name)
    size = os.path.getsize(path)
    change(path)
    assert os.path.getsize(path) == size and token_store.check(folder).problem
    with caplog.at_level(logging.WARNING):
        again = _open(config).store
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        f"token cache {folder} is damaged ({name} is not the file that was written: its SHA-256 differs from the "
        f"one meta.json holds): tokenizing again"]
    for k, v in first.items():
        np.testing.assert_array_equal(_arrays(again)[k], v, err_msg=k)


def test_a_whole_entry_says_what_its_check_read(tmp_path, caplog):
    config, first, folder = _built(tmp_path)
    nbytes = sum(os.path.getsize(os.path.join(folder, n)) for n in token_store.FILES)
    with caplog.at_level(logging.INFO, logger="infjax.data"):
        _open(config)
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"token cache {folder}:")]
    assert f"its files match their digests ({token_store.byte_size(nbytes)} read in " in line, line


def _as_another_users(folder, monkeypatch):
    """Make `folder` (and all under it) another user's: chown where this process may (root), else make this
    process another user for data/trust.py (the files stay the real user's)."""
    if os.geteuid() == 0:
        for here, dirs, files in os.walk(folder):
            for path in [here] + [os.path.join(here, n) for n in dirs + files]:
                os.lchown(path, 4242, 4242)
        return "is owned by uid 4242, not by this user"
    monkeypatch.setattr(token_store.trust.os, "geteuid", lambda: 4242)
    return "is owned by"


def _plant(folder):
    """Another user's ids under the key: the first record's ids zeroed, meta.json's digests made to agree."""
    path = os.path.join(folder, "tokens.bin")
    _flip(path, 0, 8)
    meta_path = os.path.join(folder, "meta.json")
    meta = json.load(open(meta_path))
    meta["files"]["tokens.bin"] = token_store.file_digest(path)
    json.dump(meta, open(meta_path, "w"))


@pytest.mark.parametrize("how", ["owned by another user", "writable by every user"])
def test_an_entry_another_user_may_have_written_is_refused_unless_the_cache_is_shared(tmp_path, caplog, monkeypatch,
                                                                                      how):
    """An entry planted under the key a run computes (its digests made to agree) by another user, or one that
    every user can write, is not read: one line names it, why, and the two ways on; with data.cache_shared
    it is used, and the line says so."""
    config, first, folder = _built(tmp_path)
    _plant(folder)
    if how == "owned by another user":
        why = _as_another_users(folder, monkeypatch)
    else:
        os.chmod(os.path.join(folder, "tokens.bin"), 0o666)
        why = "tokens.bin can be written by its group and every user (mode 666)"
    with pytest.raises(token_store.UserError) as e:
        _open(config)
    line = str(e.value)
    assert line.startswith(f"token cache entry {folder} is not used: ") and why in line, line
    assert line.endswith(f"Use a cache folder of your own (config.data.cache_dir; now {tmp_path / 'cache'}), or, if "
                         f"{tmp_path / 'cache'} is shared on purpose, set config.data.cache_shared=True"), line
    with caplog.at_level(logging.INFO, logger="infjax.data"):
        shared = _open(changed(config, **{"data.cache_shared": True})).store
    assert f"token cache entry {folder} is used although" in caplog.text
    assert "config.data.cache_shared=True says" in caplog.text
    assert shared.folder == folder and not np.array_equal(np.asarray(shared.tokens), first["tokens"])   # as asked


def test_an_arrow_folder_another_user_owns_is_refused_before_it_is_read(tmp_path, monkeypatch):
    config, first, folder = _built(tmp_path)
    arrow = tmp_path / "cache" / "arrow"
    [entry] = os.listdir(arrow)
    why = _as_another_users(str(arrow / entry), monkeypatch)
    with pytest.raises(token_store.UserError) as e:
        _open(config)
    assert str(e.value).startswith(f"Arrow folder {arrow / entry} is not used: ") and why in str(e.value)


def test_what_this_user_builds_is_private_whatever_its_umask(tmp_path):
    """With a umask that lets the group write (002), the entry and the Arrow folder are still this user's
    alone, so the next run trusts them."""
    old = os.umask(0o002)
    try:
        config, first, folder = _built(tmp_path)
    finally:
        os.umask(old)
    [arrow] = os.listdir(tmp_path / "cache" / "arrow")
    for path in (folder, str(tmp_path / "cache" / "arrow" / arrow)):
        assert token_store.trust.foreign(path) == "", path
        for here, dirs, files in os.walk(path):
            assert all(not os.lstat(os.path.join(here, n)).st_mode & 0o022 for n in dirs + files)


def _disk_full_at_arrow(monkeypatch):
    """datasets' JSON builder meeting a full disk as it writes the Arrow files: it wraps the OSError."""
    import errno

    import datasets

    def load_dataset(*args, cache_dir=None, **kwargs):
        try:
            raise OSError(errno.ENOSPC, "No space left on device", os.path.join(cache_dir, "json-train.arrow"))
        except OSError as e:
            raise datasets.exceptions.DatasetGenerationError("An error occurred while generating the dataset") from e
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)


def _disk_full_at_tokens(monkeypatch):
    import errno

    def save(path, value):
        raise OSError(errno.ENOSPC, "No space left on device", path)
    monkeypatch.setattr(token_store.np, "save", save)


@pytest.mark.parametrize("where", ["Arrow files", "token ids"])
def test_a_full_disk_under_the_cache_names_the_cache_what_it_needs_and_what_is_free(tmp_path, monkeypatch, where):
    """A full disk while the Arrow files or the token ids are written is the cache's disk, not the data: one
    line names the cache folder, what the build needs and what is free, exit 3; no entry is left."""
    data_file = _write(tmp_path / "d3k.jsonl", _records(10))
    (_disk_full_at_arrow if where == "Arrow files" else _disk_full_at_tokens)(monkeypatch)
    cache = tmp_path / "cache"
    with pytest.raises(token_store.RunStopped) as e:
        _open(_config(data_file, cache))
    line, size = str(e.value), token_store.byte_size(os.path.getsize(data_file))
    assert e.value.exit_code == 3 and "d3k.jsonl: cannot be read" not in line
    assert line.startswith(f"the token cache {cache} ran out of space (no space left on the device writing "), line
    assert f"needs up to about {token_store.byte_size(4 * os.path.getsize(data_file))} (4x the data files' {size}" \
           in line and " are free now. The unfinished entry was removed and nothing was trained" in line, line
    assert [n for n in os.listdir(cache / "tokens") if not n.endswith(".lock")] == []


@pytest.mark.parametrize("blank", ["missing", "null", "whitespace"])
def test_a_blank_field_late_in_the_data_stops_the_run_before_tokenizing(tmp_path, caplog, blank):
    """A field missing, null or blank at row 90 of 100 is found in the Arrow table before the tokenizing pass
    starts (which would reach it last), with the pass's own line naming the row and field; skip still skips it."""
    from infjax.data.inf_ir import BadRowError

    rows = _records(100)
    if blank == "missing":
        del rows[90]["instruction_negative"]
    else:
        rows[90]["instruction_negative"] = None if blank == "null" else " \t "
    data_file = _write(tmp_path / "msmarco.jsonl", rows)
    with caplog.at_level(logging.INFO, logger="infjax.data"), pytest.raises(BadRowError) as e:
        _open(_config(data_file, tmp_path / "cache"))
    reason = "value is None (null)" if blank != "whitespace" else "empty after cleaning"
    assert str(e.value) == (f"InF-IR split 'msmarco' row 90, field 'instruction_negative' (source column "
                            f"'instruction_negative'): {reason}")
    assert "tokenizing" not in caplog.text
    assert len(_open(_config(data_file, tmp_path / "cache", **{"data.on_bad_row": "skip"})).store) == 99
