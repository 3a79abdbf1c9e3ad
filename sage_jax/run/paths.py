"""One path layer for every file a run reads or writes under its workdir, its checkpoint folders and an evaluation's
output folder: a local folder and a `gs://` bucket (any scheme etils.epath knows, which is what orbax writes the
checkpoints with) behave the same. Inputs that are local by nature (data files, config files, HF model folders) are
read as before.

Objects are not files, so a few operations are built differently on a bucket:
- write_text / write_bytes replace the file whole: a temporary name then a rename on a local disk (a reader never
  sees half a file), one object upload on a bucket (an upload is atomic there).
- append_text (metrics.jsonl, samples.jsonl, an evaluation's samples, log.txt): an object cannot be appended to, so
  on gs:// the new text is uploaded as a small object `NAME.part-<random>` and composed onto the end of NAME (GCS's
  compose: server-side, atomic, no limit on how many appends a file gets; conditional on NAME's generation, so a
  retried request cannot append twice), then the part is deleted; each append costs four small requests and the
  bytes appended, never the file's size. Each call is durable when it returns, as a flushed local append is. A part
  left by a kill between the upload and the compose is removed by remove_parts (the metrics logger calls it when it
  opens the files). Where a store has no compose, the object is read and written back whole.
- makedirs does nothing on a bucket (no folders there), and there is no exclusive create or atomic rename: the run
  lock is a lease on a bucket (run/guard.py).

gcsfs keeps directory listings cached per process, so a file another process wrote would stay unseen; the listings
cache is turned off for gs:// (set before the first gs:// file system is made).

Emulator: with STORAGE_EMULATOR_HOST=http://HOST:PORT (the variable google-cloud-storage and gcsfs read), the
other clients are pointed at it too when this module is imported: tensorstore (orbax's array writes) through
TENSORSTORE_GCS_HTTP_URL and GOOGLE_AUTH_TOKEN_FOR_TESTING, gcsfs with anonymous credentials and without its
gRPC probe for zonal buckets. A variable set by the user wins.

Multi-host: every process must take the same branch, so a process acting on what it found (a file's presence, its
contents) asks through exists_agreed / read_agreed, which broadcast process 0's answer.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import uuid
from typing import Any, Callable, Iterator

from etils import epath

from sage_jax.run import retry
from sage_jax.run.retry import StorageUnreachable, call as _remote  # noqa: F401 (StorageUnreachable: for callers)

PathLike = str | os.PathLike


def _emulator_defaults() -> None:
    host = os.environ.get("STORAGE_EMULATOR_HOST", "")
    if host in ("", "default"):
        return
    url = host if "://" in host else f"http://{host}"
    os.environ.setdefault("TENSORSTORE_GCS_HTTP_URL", url)
    os.environ.setdefault("GOOGLE_AUTH_TOKEN_FOR_TESTING", "emulator")
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # read when gcsfs is imported
    os.environ.setdefault("FSSPEC_GCS_TOKEN", "anon")  # read when fsspec is imported; set below if it already is


def _gcs_defaults() -> None:
    _emulator_defaults()
    try:
        import fsspec.config
    except ImportError:
        return
    conf = fsspec.config.conf.setdefault("gcs", {})
    conf.setdefault("use_listings_cache", False)
    if os.environ.get("FSSPEC_GCS_TOKEN"):
        conf.setdefault("token", os.environ["FSSPEC_GCS_TOKEN"])


_gcs_defaults()


_fence: Callable[[str, bool], None] | None = None


def set_fence(check: Callable[[str, bool], None] | None) -> None:
    """check(path, renew) is called before every write or delete here (run/lease.py registers it: a run that lost
    its workdir's lease writes nothing more); it raises to refuse the write."""
    global _fence
    _fence = check


def fence(p: PathLike, renew: bool = True) -> None:
    """Refuse (raise) if this process may not write `p` now (see set_fence; a store given up: StorageUnreachable);
    for writers outside this module (a checkpoint save)."""
    if is_remote(p):
        retry.check_up()
    if _fence is not None:
        _fence(os.fspath(p), renew)


def path(p: PathLike) -> epath.Path:
    return p if isinstance(p, epath.Path) else epath.Path(os.fspath(p))


def is_remote(p: PathLike) -> bool:
    return "://" in os.fspath(p)


def absolute(p: PathLike) -> str:
    """The path as a string that names the same file from any working directory (a URL stays as it is)."""
    p = os.fspath(p)
    return p if is_remote(p) else os.path.realpath(os.path.expanduser(p))


def exists(p: PathLike) -> bool:
    return _remote(p, lambda: path(p).exists())


def isdir(p: PathLike) -> bool:
    return _remote(p, lambda: path(p).is_dir())


def isfile(p: PathLike) -> bool:
    return _remote(p, lambda: path(p).is_file())


def makedirs(p: PathLike) -> None:
    if not is_remote(p):
        os.makedirs(p, exist_ok=True)


def listdir(p: PathLike) -> list[str]:
    """The names in a folder; [] if it does not exist."""
    try:
        return _remote(p, lambda: sorted(child.name for child in path(p).iterdir()))
    except (FileNotFoundError, NotADirectoryError):
        return []


def remove(p: PathLike) -> None:
    """Delete a file; no error if it is gone already."""
    fence(p)
    with contextlib.suppress(FileNotFoundError):
        _remote(p, path(p).unlink)


def rename(src: PathLike, dst: PathLike) -> None:
    """Move a file over `dst` (atomic on a local disk; a copy and a delete on a bucket)."""
    fence(dst)
    if is_remote(src) or is_remote(dst):
        _remote(dst, lambda: path(src).replace(path(dst)))
    else:
        os.replace(src, dst)


def read_bytes(p: PathLike) -> bytes:
    return _remote(p, path(p).read_bytes)


def read_text(p: PathLike) -> str:
    return read_bytes(p).decode("utf-8")


def write_bytes(p: PathLike, data: bytes) -> None:
    """Replace the file whole (see the module doc), making its local folder if needed."""
    fence(p)
    if is_remote(p):
        _remote(p, lambda: path(p).write_bytes(data))
        return
    p = os.fspath(p)
    os.makedirs(os.path.dirname(p) or ".", exist_ok=True)
    tmp = p + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, p)


def write_text(p: PathLike, text: str) -> None:
    write_bytes(p, text.encode("utf-8"))


def create_text(p: PathLike, text: str) -> bool:
    """Write a new file only if there is none; False if there is. Exclusive on a local disk (O_EXCL) and on GCS (an
    upload with the ifGenerationMatch=0 precondition); elsewhere, and on an emulator that ignores the precondition,
    a check then a write (the run lock reads its file back: run/guard.py)."""
    data = text.encode("utf-8")
    fence(p)
    if not is_remote(p):
        try:
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        except OSError:  # a full disk: leave no empty file behind that reads as someone's lock
            os.unlink(p)
            raise
        return True
    fs = _fsspec(p)
    try:
        if _is_gcs(fs):
            _remote(p, lambda: fs.pipe_file(os.fspath(p), data, mode="create"))
            return True
    except FileExistsError:
        return False
    except TypeError:  # a gcsfs without exclusive uploads
        pass
    if exists(p):
        return False
    write_bytes(p, data)
    return True


def _fsspec(p: PathLike):
    """The fsspec file system etils.epath uses for a URL (gcsfs for gs://), or None."""
    try:
        from etils.epath import backend
        return backend.fsspec_backend.fs(os.fspath(p))
    except (ImportError, ValueError):
        return None


def missing_bucket(p: PathLike) -> str | None:
    """The bucket of a gs:// path if the store says there is no such bucket; else None."""
    fs = _fsspec(p) if is_remote(p) else None
    if not _is_gcs(fs):
        return None
    bucket = fs.split_path(os.fspath(p))[0]
    try:
        _remote(p, lambda: fs.call("GET", "b/{}", bucket))
    except FileNotFoundError:
        return bucket
    return None


def _is_gcs(fs) -> bool:
    return fs is not None and bool({"gs", "gcs"} & set(getattr(fs, "protocol", ()))) and hasattr(fs, "call")


def append_text(p: PathLike, text: str) -> None:
    """Add `text` at the end of the file, creating it (see the module doc for a bucket)."""
    if not text:
        return
    fence(p)
    if not is_remote(p):
        os.makedirs(os.path.dirname(os.fspath(p)) or ".", exist_ok=True)
        with open(p, "a", encoding="utf-8") as f:
            f.write(text)
        return
    fs, target = _fsspec(p), path(p)
    if not _is_gcs(fs):
        old = read_text(p) if exists(p) else ""
        write_text(p, old + text)
        return
    part = target.with_name(f"{target.name}.part-{uuid.uuid4().hex}")
    _remote(p, lambda: part.write_text(text))
    try:
        _compose(fs, os.fspath(target), os.fspath(part))
    except FileNotFoundError:  # the first append: nothing to compose onto
        _remote(p, lambda: target.write_text(text))
    finally:
        with contextlib.suppress(OSError):  # a part left behind is removed by remove_parts
            remove(part)


def _compose(fs, target: str, part: str) -> None:
    """target = target + part, server-side (GCS compose). The request names the target's generation, so a retry of
    a compose that went through (gcsfs retries a 5xx or a lost answer) fails its precondition instead of appending
    the part twice: a 412 is taken as done, since one process writes the file."""
    generation = _remote(target, lambda: fs.info(target)["generation"])  # FileNotFoundError: no target yet
    bucket, key, _ = fs.split_path(target)
    body = {"sourceObjects": [{"name": key}, {"name": fs.split_path(part)[1]}],
            "destination": {"contentType": "text/plain; charset=utf-8"}}
    try:  # retried with the same generation: a compose that went through is not done twice
        _remote(target, lambda: fs.call("POST", "b/{}/o/{}/compose", bucket, key, ifGenerationMatch=str(generation),
                                        json=body, headers={"Content-Type": "application/json"}))
    except FileExistsError:
        pass


def remove_parts(p: PathLike) -> None:
    """Delete the parts an append killed before its compose left beside `p` (append_text on a bucket)."""
    if is_remote(p):
        target = path(p)
        for name in listdir(target.parent):
            if name.startswith(f"{target.name}.part-"):
                remove(target.parent / name)


def upload_tree(local_dir: PathLike, dest: PathLike) -> None:
    """Copy every file under a local folder to `dest` (a folder or a bucket prefix), keeping the layout."""
    for root, _, files in os.walk(local_dir):
        for name in files:
            rel = os.path.relpath(os.path.join(root, name), local_dir)
            with open(os.path.join(root, name), "rb") as f:
                write_bytes(path(dest) / rel, f.read())


@contextlib.contextmanager
def staged_dir(dest: PathLike, writer: bool = True) -> Iterator[str]:
    """A local folder to write `dest`'s files into with libraries that take only local paths (safetensors,
    transformers' save_pretrained): `dest` itself when it is local; else a temporary folder that the writer uploads
    to `dest` when the block ends without an error."""
    if writer:
        fence(dest)
    if not is_remote(dest):
        yield os.fspath(dest)
        return
    tmp = tempfile.mkdtemp(prefix="sage_jax_stage_")
    try:
        yield tmp
        if writer:
            upload_tree(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_dir(dest: PathLike, write: Callable[[str], Any], writer: bool | None = None) -> None:
    """write(local folder) through staged_dir(dest); writer defaults to process 0 (call on every process)."""
    with staged_dir(dest, _processes()[0] == 0 if writer is None else writer) as local:
        write(local)


# ------------------------------------------------------------------------------------------ what process 0 found

def _processes():
    """(this process's index, the process count); (0, 1) when jax is not imported."""
    jax = sys.modules.get("jax")
    return (0, 1) if jax is None else (jax.process_index(), jax.process_count())


def _broadcast(values: list[int]) -> list[int]:
    import numpy as np
    from jax.experimental import multihost_utils
    return [int(v) for v in np.asarray(multihost_utils.broadcast_one_to_all(np.asarray(values, np.int32)))]


def exists_agreed(p: PathLike) -> bool:
    """Whether process 0 finds the file, on every process (call on all of them)."""
    index, count = _processes()
    found = exists(p) if index == 0 or count == 1 else False
    return found if count == 1 else bool(_broadcast([int(found)])[0])


def read_agreed(p: PathLike) -> bytes | None:
    """The file's bytes as process 0 read them (None if it does not exist), on every process (call on all)."""
    index, count = _processes()
    data, error = None, ""
    if index == 0 or count == 1:
        try:
            data = read_bytes(p)
        except FileNotFoundError:
            pass
        except OSError as e:
            error = f"{type(e).__name__}: {e}"
    if count == 1:
        if error:
            raise OSError(f"cannot read {p} ({error})")
        return data
    import numpy as np
    from jax.experimental import multihost_utils
    (size,) = _broadcast([-2 if error else -1 if data is None else len(data)])
    if size == -2:
        raise OSError(f"cannot read {p} on process 0" + (f" ({error})" if error else ""))
    if size == -1:
        return None
    buf = np.frombuffer(data, np.uint8) if index == 0 else np.zeros(size, np.uint8)
    return np.asarray(multihost_utils.broadcast_one_to_all(buf)).astype(np.uint8).tobytes()
