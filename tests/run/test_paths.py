"""sage_jax/run/paths.py on a local disk (a bucket: tests/run/test_gcs_workdir.py)."""

from __future__ import annotations

import os

from sage_jax.run import paths


def test_local_files_read_write_append_create_and_list(tmp_path):
    f = tmp_path / "a" / "b.txt"
    paths.write_text(f, "one\n")  # makes its folder; a temporary name then a rename
    assert f.read_text() == "one\n" and not (tmp_path / "a" / "b.txt.tmp").exists()
    paths.append_text(f, "two\n")
    paths.append_text(f, "")
    assert paths.read_text(f) == "one\ntwo\n" and paths.read_bytes(f) == b"one\ntwo\n"
    assert not paths.create_text(f, "three\n") and paths.create_text(tmp_path / "a" / "c.txt", "new")
    assert paths.listdir(tmp_path / "a") == ["b.txt", "c.txt"] and paths.listdir(tmp_path / "none") == []
    assert paths.isfile(f) and paths.isdir(tmp_path / "a") and not paths.exists(tmp_path / "none")
    paths.rename(f, tmp_path / "a" / "d.txt")
    paths.remove(tmp_path / "a" / "c.txt")
    paths.remove(tmp_path / "a" / "c.txt")  # gone already: no error
    assert paths.listdir(tmp_path / "a") == ["d.txt"]
    assert paths.exists_agreed(tmp_path / "a" / "d.txt") and paths.read_agreed(tmp_path / "a" / "none") is None
    assert paths.read_agreed(tmp_path / "a" / "d.txt") == b"one\ntwo\n"


def test_urls_stay_urls_and_local_paths_become_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert paths.absolute("gs://bucket/run") == "gs://bucket/run" and paths.is_remote("gs://bucket/run")
    assert paths.absolute("run") == os.path.realpath(tmp_path / "run") and not paths.is_remote("run")
    assert str(paths.path("gs://bucket/run") / "rl") == "gs://bucket/run/rl"
    paths.makedirs("gs://bucket/run")  # nothing to make on a bucket, and no local "gs:" folder
    assert not (tmp_path / "gs:").exists()


def test_a_local_destination_is_written_in_place(tmp_path):
    def write(folder):  # e.g. safetensors / save_pretrained, which take local paths only
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "x"), "w") as f:
            f.write("x")
    paths.write_dir(tmp_path / "out", write)
    assert (tmp_path / "out" / "x").read_text() == "x"
