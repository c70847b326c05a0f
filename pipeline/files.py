"""Atomic outputs and validated JSONL inputs.

Every file or folder a stage produces is written under a temporary name in the same directory and
renamed into place, so a crash never leaves a half-written output that DVC would then cache.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Any, Iterator, Sequence

from .errors import BusyError, CheckpointError, DataError, StorageError, UserError, shown

# One record (a JSONL line, a dataset row) may hold at most this many bytes. The longest sequence
# any stage trains on is a few thousand tokens (tens of KB of text even for a hub model's
# max_length); a line 30x larger than that is refused before anything tokenizes it, which would
# otherwise cost ~0.2 GB per MB of text in the tokenizer.
MAX_RECORD_BYTES = 1 << 20
# A whole input file: far more than any of ours; what is refused here is an endless stream.
MAX_FILE_BYTES = 1 << 33


def tree(path: str | Path) -> list[tuple[str, Path]]:
    """The files under folder `path`, sorted, with their names relative to it; a file (or a path
    that does not exist) is itself, named ""."""
    path = Path(path)
    if not path.is_dir():
        return [("", path)]
    return [(f.relative_to(path).as_posix(), f) for f in sorted(p for p in path.rglob("*") if p.is_file())]


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def content_hash(paths: Sequence[str | Path]) -> str:
    """sha256 over the files under each path: its position in `paths`, each file's relative name
    and the sha256 of its bytes ("missing" for a path that does not exist). Where the inputs lie
    does not enter, so the same inputs in another folder hash the same. The one content hash of the
    package: resume fingerprints and MLflow's lineage both use it."""
    h = hashlib.sha256()
    for i, path in enumerate(paths):
        for rel, f in tree(path):
            h.update(f"{i}/{rel}\t{file_sha256(f) if f.is_file() else 'missing'}\n".encode())
    return h.hexdigest()


def regular_file(path: str | Path, what: str = "file", error: type[UserError] = DataError) -> Path:
    """`path` when it names a regular file (a symlink to one counts), else `error` naming it: a
    folder, a FIFO, a device or a socket is never opened (a read from one can block or never end)."""
    path = Path(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise error(f"{path}: no such {what}") from None
    except OSError as err:
        raise error(f"{path}: cannot read the {what} ({err.strerror})") from None
    if stat.S_ISDIR(st.st_mode):
        raise error(f"{path}: is a folder, not a {what}")
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{path}: not a regular file (a FIFO, device or socket), not a {what}")
    return path


def check_folder(path: str | Path) -> None:
    """A local checkpoint must be a folder whose files are all regular files (a FIFO or device named
    model.safetensors would block or never end the read); a hub id (no such local path) is left
    to the loader."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        return
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a checkpoint folder")
    for entry in path.iterdir():
        if not entry.is_dir():
            regular_file(entry, "checkpoint file", CheckpointError)


def read_input(path: str | Path, what: str = "file", error: type[UserError] = DataError,
               limit: int = MAX_FILE_BYTES) -> bytes:
    """The bytes of an input file, read only after `regular_file` and the size `limit` allow it:
    the one way every input (data, params, checkpoint metadata, resumable state) is opened."""
    path = regular_file(path, what, error)
    try:
        size = path.stat().st_size
        if size > limit:
            raise error(f"{path}: {size} bytes, more than the {limit} a {what} may have")
        # Read what the file holds (plus one byte, to see one that grew past the limit meanwhile):
        # read(limit + 1) would allocate the whole limit first, which fails under an address-space
        # limit (ulimit -v) or on a small machine whatever the file's size.
        with open(path, "rb") as f:
            data = f.read(size + 1)
        if len(data) > limit:
            raise error(f"{path}: more than the {limit} bytes a {what} may have")
        return data
    except OSError as err:
        raise error(f"{path}: cannot read the {what} ({err.strerror})") from None


def check_unicode(row: Any, where: str, key: str = "") -> None:
    """Every string in a decoded record must be valid Unicode: JSON's `\\ud800` escapes decode to
    lone surrogates that no encoder (or tokenizer) accepts."""
    if isinstance(row, str):
        try:
            row.encode("utf-8")
        except UnicodeEncodeError as err:
            raise DataError(f"{where}: field '{key}' is not valid Unicode (a lone surrogate "
                            f"{shown(row[err.start:err.end])} at character {err.start})") from None
    elif isinstance(row, dict):
        for k, v in row.items():
            check_unicode(v, where, f"{key}.{k}" if key else str(k))
    elif isinstance(row, list):
        for i, v in enumerate(row):
            check_unicode(v, where, f"{key}[{i}]")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (write a number)")


def parse_json(text: str | bytes) -> Any:
    """JSON without the parser's failure modes: NaN/Infinity are refused, and nesting too deep
    (RecursionError) or integers too long for Python (ValueError) become ValueError with the
    reason, for the caller to name the file and line."""
    try:
        return json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as err:
        raise ValueError(f"{err.msg} (column {err.colno})") from None
    except RecursionError:
        raise ValueError("nested too deeply") from None


def umask_mode(base: int) -> int:
    """`base` (0o666 for a file, 0o777 for a folder) less the process umask: the mode open() or
    mkdir() would give. mkstemp and mkdtemp create 0o600 / 0o700 (private temporaries); an output
    renamed into place must not stay private to its writer (a shared DVC cache, a team's run folder)."""
    mask = os.umask(0)
    os.umask(mask)
    return base & ~mask


# Below this many free bytes on a folder's file system, a writer's failure is taken as the disk being
# full: torch.save reports ENOSPC as `RuntimeError: [enforce fail at inline_container.cc] unexpected pos`,
# with neither the cause nor the path.
FULL_DISK_BYTES = 1 << 20


def write_failure(err: BaseException, path: Path) -> str | None:
    """Why writing under `path` failed, when `err` is the storage's fault and not a bug: an OS error
    (no space, quota, read-only file system, I/O error...), or any writer's error while the file
    system holding `path` is full (safetensors and torch wrap ENOSPC in their own errors). None for
    anything else, which keeps its traceback."""
    if isinstance(err, OSError) and err.errno is not None:
        return os.strerror(err.errno)
    if not isinstance(err, Exception):
        return None   # interrupts and exits pass unchanged
    if "os error 28" in str(err) or "No space left" in str(err):
        return os.strerror(errno.ENOSPC)
    folder = next((p for p in (path, *path.parents) if p.exists()), None)
    with contextlib.suppress(OSError):
        if folder is not None and shutil.disk_usage(folder).free < FULL_DISK_BYTES:
            first = next((line for line in str(err).splitlines() if line.strip()), type(err).__name__)
            return f"{os.strerror(errno.ENOSPC)} ({shown(first, 120)})"
    return None


@contextlib.contextmanager
def writing(path: str | Path, what: str = "file") -> Iterator[None]:
    """The one guard around writing an output or a checkpoint: a failure of the storage (see
    `write_failure`) becomes one StorageError naming `path` and the cause. Callers remove their
    temporary files as the error passes; what was complete before stays as it was."""
    try:
        yield
    except UserError:
        raise
    except BaseException as err:
        cause = write_failure(err, Path(path))
        if cause is None:
            raise
        raise StorageError(f"{path}: cannot write the {what}: {cause}; nothing earlier was changed") from None


def atomic_write_text(path: str | Path, text: str) -> None:
    path = Path(path)
    with writing(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            os.fchmod(fd, umask_mode(0o666))
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise


def strict_json(obj: Any) -> Any:
    """`obj` with every NaN or infinite float as None: JSON has no NaN (Python writes a bare `NaN`
    that strict readers, jq and JavaScript among them, refuse). A metric undefined on a run's data,
    such as a rank correlation over samples whose scores are all equal, reads as null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: strict_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict_json(v) for v in obj]
    return obj


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(strict_json(obj), indent=2, sort_keys=True, allow_nan=False) + "\n")


def write_jsonl(path: str | Path, rows: Sequence[dict[str, Any]]) -> None:
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


@contextlib.contextmanager
def atomic_dir(target: str | Path, what: str = "folder") -> Iterator[Path]:
    """Yield a fresh temporary folder; on success it replaces `target` whole, on error it vanishes.

    The old `target` is kept until the new one is complete, so an interrupted run loses nothing;
    a full disk while the folder is written is one StorageError naming `target` (`writing`).
    """
    target = Path(target)
    with writing(target, what):
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp"))
    try:
        with writing(target, what):
            tmp.chmod(umask_mode(0o777))
            yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    swap_in(tmp, target)


def swap_in(new: Path, target: Path) -> None:
    """Replace folder `target` by the complete folder `new` (the old one stays until then)."""
    old = target.with_name(f".{target.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if target.exists():
        os.replace(target, old)
    os.replace(new, target)
    shutil.rmtree(old, ignore_errors=True)


def read_json_object(path: str | Path, what: str = "JSON file", error: type[UserError] = DataError,
                     limit: int = MAX_RECORD_BYTES) -> dict[str, Any]:
    """A small JSON file that must hold an object (stats.json, state.json, a model's config.json),
    read through `read_input`; anything else is one `error` naming the file."""
    return json_object(read_input(path, what, error, limit), str(path), error)


def decode_utf8(raw: bytes, where: str, error: type[UserError] = DataError) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise error(f"{where}: invalid UTF-8 at byte {err.start}") from None


def json_object(raw: bytes, where: str, error: type[UserError] = DataError) -> dict[str, Any]:
    """The JSON object in `raw` (a file, or one JSONL line), or one `error` at `where`."""
    text = decode_utf8(raw, where, error)
    try:
        obj = parse_json(text)
    except ValueError as err:
        raise error(f"{where}: malformed JSON: {shown(str(err), 200)}") from None
    if not isinstance(obj, dict):
        raise error(f"{where}: expected a JSON object, got {type(obj).__name__}")
    return obj


def numbered_jsonl(path: str | Path) -> list[tuple[int, dict[str, Any]]]:
    """(line number, object) for every non-blank line; a malformed line is a `file:line:` error."""
    path = Path(path)
    raw = read_input(path)
    rows = []
    for lineno, line in enumerate(raw.split(b"\n"), start=1):
        if not line.strip():
            continue
        if len(line) > MAX_RECORD_BYTES:
            raise DataError(f"{path}:{lineno}: a record of {len(line)} bytes; at most {MAX_RECORD_BYTES} are "
                            "read (far above any stage's token limit)")
        row = json_object(line, f"{path}:{lineno}")
        check_unicode(row, f"{path}:{lineno}")
        rows.append((lineno, row))
    if not rows:
        raise DataError(f"{path}: no records")
    return rows


def read_records(path: str | Path, required: Sequence[str], nonempty: Sequence[str] = (),
                 allowed: Sequence[str] | None = None) -> list[tuple[str, dict[str, Any]]]:
    """(`file:line`, row) for every record of a JSONL file, each checked; errors read
    `file:line: what is wrong`. `required` fields must be present; `nonempty` fields must be
    strings with visible text; with `allowed` (a fixed schema) any other field is an error; ids
    (an `id` field) must be unique."""
    records = []
    for lineno, row in numbered_jsonl(path):
        where = f"{path}:{lineno}"
        for key in required:
            if key not in row:
                raise DataError(f"{where}: missing field '{key}'")
        for key in nonempty:
            nonempty_text(row.get(key), where, key)
        if allowed is not None:
            check_fields(where, row, allowed)
        records.append((where, row))
    check_ids(records)
    return records


def read_jsonl(path: str | Path, required: Sequence[str], nonempty: Sequence[str] = (),
               allowed: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """The rows of `read_records`, without their locations."""
    return [row for _, row in read_records(path, required, nonempty, allowed)]


def nonempty_text(value: Any, where: str, key: str) -> str:
    """`value` when it is a string with something besides white space, else a DataError naming
    the record (`where`) and the field (the one check of text fields, whatever the source)."""
    if not isinstance(value, str):
        raise DataError(f"{where}: field '{key}' must be a string, got {type(value).__name__}")
    if not value.strip():
        raise DataError(f"{where}: field '{key}' is empty")
    return value


def check_fields(where: str, row: dict[str, Any], allowed: Sequence[str]) -> None:
    """A record of a fixed schema holds no field outside `allowed`."""
    extra = sorted(set(row) - set(allowed))
    if extra:
        raise DataError(f"{where}: unexpected field '{extra[0]}' (this file's fields: {', '.join(allowed)})")


def check_ids(records: Sequence[tuple[str, dict[str, Any]]], key: str = "id") -> None:
    """Records that carry an id must not share one (a duplicated record, or two files merged)."""
    first: dict[str, str] = {}
    for where, row in records:
        if key in row and row[key] is not None:
            value = json.dumps(row[key], sort_keys=True, default=str)
            if value in first:
                raise DataError(f"{where}: duplicate {key} {value} (first at {first[value]})")
            first[value] = where


def remove_stale(*paths: Path) -> None:
    """Remove files or folders a previous run of a stage wrote and this run does not (an adapter/
    after LoRA was switched off, a DeepSpeed config after going back to plain PyTorch), so a
    stage's folder never mixes two runs."""
    for path in paths:
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


# The lock file of a stage's folder: never removed (its inode is what is locked; a lock file that
# were deleted and re-created could be held by two processes at once), released with the process.
LOCK = ".lock"


@contextlib.contextmanager
def exclusive(folder: Path, stage: str) -> Iterator[None]:
    """Hold `folder` for one run of `stage` (an advisory `flock`, released when the process ends
    however it ends): a second run on the same folder, by DVC, Snakemake or by hand, is refused at
    once with one BusyError naming the holder, before it changes anything."""
    import fcntl

    with writing(folder / LOCK, "lock file"):
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder / LOCK, os.O_RDWR | os.O_CREAT, umask_mode(0o666))
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "another process"
            raise BusyError(f"{folder}: another run of a stage is writing this folder ({shown(holder)}); "
                            f"wait for it to end, or give this {stage} run another --out") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{stage}, pid {os.getpid()} on {os.uname().nodename}\n".encode(), 0)
        yield
    finally:
        os.close(fd)


# Where a stage writes this run's outputs (`pending(folder)`) until `commit` moves them into its
# folder: a run that fails, however late, leaves the folder's earlier outputs as they were.
PENDING = ".pending"


def pending(folder: Path) -> Path:
    """A fresh, empty pending folder in `folder` (what a killed run left there is discarded)."""
    path = folder / PENDING
    with writing(path, "output folder"):
        folder.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        path.chmod(umask_mode(0o777))
    return path


def commit(folder: Path, optional: Sequence[str] = ()) -> None:
    """Move the pending outputs into `folder`, each file or folder by rename (no new space needed,
    so a full disk cannot stop it halfway); of the `optional` outputs (adapter/,
    deepspeed_config.json), those this run did not write are removed, so the folder never mixes
    two runs."""
    path = folder / PENDING
    written = sorted(path.iterdir())
    for entry in written:
        if entry.is_dir():
            swap_in(entry, folder / entry.name)
        else:
            os.replace(entry, folder / entry.name)
    remove_stale(*(folder / name for name in optional if name not in {e.name for e in written}))
    path.rmdir()


def discard(folder: Path) -> None:
    """Remove the pending outputs of a run that failed or stopped (its checkpoint holds its state)."""
    shutil.rmtree(folder / PENDING, ignore_errors=True)
