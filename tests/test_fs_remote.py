"""jax_tinybert.fs on gs:// URLs, through etils.epath and gcsfs, against a local GCS emulator
(tests/helpers/gcs_emulator.py): the same calls the run makes on a bucket workdir."""
import json
import os
import uuid

import numpy as np
import pytest

from helpers import gcs_emulator

from jax_tinybert import fs

pytestmark = pytest.mark.skipif(gcs_emulator.available() is not None,
                                reason=str(gcs_emulator.available()))


@pytest.fixture(scope="module")
def bucket():
    with gcs_emulator.running() as emu:
        yield f"gs://{emu.bucket}"


@pytest.fixture
def root(bucket):
    return f"{bucket}/t-{uuid.uuid4().hex[:8]}"


_objects = gcs_emulator.objects


def test_atomic_write_and_basic_calls(root):
    path = f"{root}/run/config.json"
    fs.write_json_atomic(path, {"a": 1})
    assert fs.exists(path) and fs.isfile(path) and not fs.isdir(path)
    assert fs.isdir(f"{root}/run") and fs.listdir(f"{root}/run") == ["config.json"]
    with fs.open_file(path) as fh:
        assert json.load(fh) == {"a": 1}
    assert fs.getsize(path) == len('{"a": 1}')
    # A failing block uploads nothing: the old object stays whole.
    with pytest.raises(RuntimeError):
        with fs.atomic_open(path, "w") as fh:
            fh.write("half")
            raise RuntimeError("killed")
    with fs.open_file(path, "rb") as fh:
        assert fh.read() == b'{"a": 1}'
    assert _objects(root) == ["run/config.json"]          # no temporary object either
    with pytest.raises(ValueError, match="object store"):
        fs.open_file(path, "a")
    with pytest.raises(FileNotFoundError):
        fs.listdir(f"{root}/none")
    fs.rmtree(f"{root}/run")
    assert not fs.exists(path)
    fs.rmtree(f"{root}/run")    # missing: no error


def test_publish_dir_replaces_the_folder_last_file_last(root, monkeypatch):
    out = f"{root}/cache/teacher"
    for version in ("old", "new"):
        tmp = fs.staging_dir(out)
        assert not fs.is_remote(tmp) and os.path.isdir(tmp)
        os.makedirs(os.path.join(tmp, "sub"))
        for rel in ("a.npy", "sub/b.npy", "meta.json"):
            with open(os.path.join(tmp, rel), "w") as fh:
                fh.write(f"{version} {rel}")
        if version == "old":
            with open(os.path.join(tmp, "only_old"), "w") as fh:
                fh.write("x")
        copied = []
        fsys = fs.url_fs(out)[0]
        real_copy = fsys.copy
        monkeypatch.setattr(fsys, "copy", lambda a, b, **k: (copied.append(b), real_copy(a, b, **k)))
        fs.publish_dir(tmp, out, last=["meta.json"])
        monkeypatch.undo()
        assert not os.path.exists(tmp)
        assert copied[-1].endswith("/meta.json"), copied
    assert _objects(f"{root}/cache") == ["teacher/a.npy", "teacher/meta.json", "teacher/sub/b.npy"]
    with fs.open_file(f"{out}/sub/b.npy") as fh:
        assert fh.read() == "new sub/b.npy"
    local = fs.local_mirror(out)
    with open(os.path.join(local, "sub", "b.npy")) as fh:
        assert fh.read() == "new sub/b.npy"
    assert sorted(os.listdir(local)) == ["a.npy", "meta.json", "sub"]


def test_clean_stale_temps_on_a_bucket(root):
    out = f"{root}/export"
    dead = f"{root}/.export.tmp-{fs._host()}-999999999-abcd1234"     # pid not running
    live = f"{root}/{fs._prefix('export')}ffff0000"                  # this process
    foreign = f"{root}/.export.tmp-otherhost-12-abcd"                # other host, fresh
    for d in (dead, live, foreign):
        with fs.open_file(f"{d}/config.json", "w") as fh:
            fh.write("{}")
    assert fs.clean_stale_temps(out) == [dead]
    assert _objects(root) == [f"{os.path.basename(foreign)}/config.json",
                              f"{os.path.basename(live)}/config.json"]


def test_missing_backend_is_one_line(monkeypatch):
    with pytest.raises(fs.RemoteFSError, match="pip install"):
        fs.url_fs("nosuchproto://bucket/x")


def test_packed_corpus_cache_in_a_bucket(root, teacher_dir, tmp_path):
    """The memmapped corpus cache: built locally, published to the bucket (meta.json last),
    and read back by a later run from a downloaded copy: same sequences as a local cache."""
    from jax_tinybert.data import corpus, tokenize

    tok = tokenize.load_tokenizer(teacher_dir)
    text = tmp_path / "c.txt"
    text.write_text("".join(f"Sentence number {i} of the tiny corpus.\n" + ("\n" if i % 3 == 2 else "")
                            for i in range(60)))
    local = corpus.build_packed_corpus([str(text)], tok, 32, cache_dir=str(tmp_path / "cache"))
    built = corpus.build_packed_corpus([str(text)], tok, 32, cache_dir=f"{root}/cache")
    names = _objects(f"{root}/cache")
    assert len(names) == 4 and all(n.startswith("packed-32-") for n in names), names
    assert sorted(n.split("/")[1] for n in names) == ["input_ids.bin", "meta.json", "offsets.bin",
                                                      "token_type_ids.bin"]
    again = corpus.build_packed_corpus([str(text)], tok, 32, cache_dir=f"{root}/cache")
    for ds in (built, again):
        assert len(ds) == len(local) > 1
        np.testing.assert_array_equal(np.asarray(ds.input_ids), np.asarray(local.input_ids))
        np.testing.assert_array_equal(np.asarray(ds.offsets), np.asarray(local.offsets))


def test_scratch_dirs_of_dead_processes_are_removed():
    """Local working folders of bucket outputs (staged uploads, downloads, metrics) left by a
    killed process are removed by the next one; a live process's are kept."""
    mine = fs.scratch_dir("mirror")
    parent = os.path.dirname(mine)
    dead = os.path.join(parent, f".mirror.tmp-{fs._host()}-999999999-abcd1234")
    os.makedirs(dead)
    again = fs.scratch_dir("mirror")
    assert not os.path.exists(dead) and os.path.isdir(mine) and os.path.isdir(again)
    for d in (mine, again):
        os.rmdir(d)
