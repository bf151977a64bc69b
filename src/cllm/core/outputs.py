"""What a command may write: one rule for every command's output folder and files.

A folder is a command's own only when it carries the marker that command wrote there
(`.cllm-run.json`: the command, a run id, when, the cllm version), never because a file name
in it matches. So:

- a new or empty folder becomes the command's (`claim_folder` writes the marker);
- a folder with the same command's marker is that command's earlier run (resumed or redone);
- a folder with another command's marker, or with files and no marker (the user's own, a
  model's checkpoint), is refused in one line, unless `--force`, which writes there anyway;
- an existing file is replaced only when it is what the command writes there (`check_new_file`
  asks its caller) or with `--force`; a model's own draft table or heads only with `--force`;
- an input is never an output, `--force` or not: no output path is (or lies inside, or links
  to) one of the command's own inputs, except the places cllm keeps beside a model (`Input.owned`:
  its draft table, tuned settings, heads); no output is a file of a checkpoint folder (one with a
  config.json) that cllm did not write there; and two outputs of one command never share a path;
- a path that is a file where a folder is wanted, or a folder where a file is, or that cannot
  be written, is one line, before anything is written.

Files are written through `replacing`: a temporary file with a unique name beside the output,
renamed over it once whole, so neither a half-written file nor a user's file of a fixed
temporary name (`<name>.tmp`) is ever left or lost.

`check_folder` looks and writes nothing: commands call it for every output before their first
long stage, and `claim_folder` when they write their first file, so a run refused on a bad
input leaves no folder behind.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from cllm.core import __version__
from cllm.core.errors import UserError, first_line

MARKER = ".cllm-run.json"
PARTIAL = ".partial"  # the suffix of `replacing`'s temporary files (`.<name>.<random>.partial`)


@dataclass(frozen=True)
class Input:
    """A path a command reads, which none of its outputs may be, lie inside or link to.

    `owned`: paths relative to a folder input where the command may write all the same (a
    model's `drafts/`, its `decode_defaults.json`, its `medusa/` heads)."""

    flag: str
    path: str | Path | None
    owned: tuple[str | Path, ...] = ()


def _inputs(inputs: Iterable[Input | tuple]) -> list[Input]:
    return [i if isinstance(i, Input) else Input(*i) for i in inputs]


def is_checkpoint_folder(path: Path) -> bool:
    """A Hugging Face checkpoint folder: one holding a config.json."""
    return (path / "config.json").is_file()


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def check_not_input(path: str | Path, inputs: Iterable[Input | tuple], *, flag: str) -> None:
    """A one-line UserError when the output `path` is one of `inputs`, lies inside one (but for
    its `owned` places), is a link or a hard link to one, or is a file of a checkpoint folder:
    such a write would destroy what the command reads. Writes nothing."""
    out = Path(path).expanduser().resolve()  # follows links, the output's own included
    owned = False  # at a place cllm keeps beside an input model
    for given in _inputs(inputs):
        if not given.path or not Path(given.path).expanduser().exists():
            continue
        source = Path(given.path).expanduser().resolve()
        if out == source or _same_file(out, source):
            raise UserError(f"{flag} {path} is the {given.flag} {'folder' if source.is_dir() else 'file'}: "
                            "choose another path")
        if source.is_dir() and out.is_relative_to(source):
            inside = out.relative_to(source)
            if not any(inside == Path(o) or inside.is_relative_to(o) for o in given.owned):
                raise UserError(f"{flag} {path} lies inside the {given.flag} folder {given.path}: choose a path "
                                "outside it")
            owned = True
        if source.is_dir() and out.is_file() and out.stat().st_nlink > 1:  # a hard link to a file inside
            if any(_same_file(out, f) for f in source.rglob("*") if f.is_file()):
                raise UserError(f"{flag} {path} is a link to a file of the {given.flag} folder: choose another "
                                "path")
    if not owned and out.is_file() and is_checkpoint_folder(out.parent):
        raise UserError(f"{flag} {path} is a file of the model checkpoint in {out.parent}: choose another path")


def check_distinct(outputs: Iterable[tuple[str, str | Path | None]]) -> None:
    """A one-line UserError when two outputs of one command are the same path."""
    seen: dict[Path, str] = {}
    for flag, path in outputs:
        if not path:
            continue
        resolved = Path(path).expanduser().resolve()
        if resolved in seen:
            raise UserError(f"{flag} and {seen[resolved]} are the same path ({path}): give each its own")
        seen[resolved] = flag


@contextmanager
def replacing(path: str | Path) -> Iterator[Path]:
    """A new temporary file beside `path`, with a name no other file has, for the caller to write;
    renamed over `path` when the block ends without an error (a link at `path` is replaced, not
    written through), removed when it raises. It gets the permissions the user's umask gives new
    files."""
    path = Path(path)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=PARTIAL)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o666 & ~umask)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def read_marker(folder: Path) -> dict | None:
    """The marker a cllm command wrote in `folder`, or None."""
    try:
        marker = json.loads((folder / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) and "command" in marker else None


def _writable(path: Path, flag: str) -> None:
    """A one-line UserError unless the folder `path` would be created in (or is) can be written."""
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"{flag} {path}: {existing} is not writable")


@contextmanager
def write_failures(path: str | Path) -> Iterator[None]:
    """An OSError while `path` is written (a full disk, a read-only place) as one line naming
    `path`: a failed write's error names no file, or only the temporary one."""
    try:
        yield
    except OSError as exc:
        raise UserError(f"cannot write {path}: {exc.strerror or first_line(exc)}") from None


def check_folder(path: str | Path, command: str, *, force: bool | None = None, flag: str = "--out",
                 inputs: Iterable[Input | tuple[str, str | Path | None]] = ()) -> Path:
    """Whether `command` may write into the folder `path` (see the module docstring); writes
    nothing. `inputs`: what the command reads (`Input`, or (flag, path)), which it must never
    write into; `force`: the command's --force (None: it has none)."""
    path = Path(path).expanduser()
    if path.exists() and not path.is_dir():
        raise UserError(f"{flag} {path} is a file, not a folder")
    check_not_input(path, inputs, flag=flag)
    _writable(path, flag)
    if not path.is_dir() or not any(path.iterdir()):
        return path
    marker = read_marker(path)
    if force and is_checkpoint_folder(path) and (marker is None or marker["command"] != command):
        raise UserError(f"{flag} {path} is a model checkpoint folder: choose a new folder (--force never writes "
                        "into a model)")
    if force:
        return path
    if marker is None:
        hint = ", or --force to write into it anyway" if force is not None else ""
        raise UserError(f"{flag} {path} holds files cllm {command} did not write (no {MARKER}): choose a new "
                        f"folder{hint}")
    if marker["command"] != command:
        raise UserError(f"{flag} {path} holds a cllm {marker['command']} run, not a cllm {command} one: choose "
                        "another folder")
    return path


def claim_folder(path: str | Path, command: str) -> Path:
    """Create `path` if needed and mark it as `command`'s (kept when it is already); call it
    just before the first file is written."""
    path = Path(path).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        if read_marker(path) is None:
            marker = {"command": command, "run_id": uuid.uuid4().hex[:12], "cllm_version": __version__,
                      "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
            (path / MARKER).write_text(json.dumps(marker) + "\n", encoding="utf-8")
    except OSError as exc:
        raise UserError(f"cannot write to {path}: {exc.strerror or first_line(exc)}") from None
    return path


@contextmanager
def removed_on_early_failure(path: str | Path, command: str, *, useful: Callable[[Path], bool]) -> Iterator[None]:
    """The folder `path`, when this block created it and it ends in an error (a refusal, a failed
    load, Ctrl-C) before anything `useful` was written there (a checkpoint, a shard: what a rerun
    resumes from), is removed: a failed first run leaves no stub folder behind. Never a folder
    that existed before the block, nor one `command` did not mark (`claim_folder`)."""
    path = Path(path).expanduser()
    existed = path.exists()
    try:
        yield
    except BaseException:
        if not existed and path.is_dir() and (read_marker(path) or {}).get("command") == command \
                and not useful(path):
            shutil.rmtree(path, ignore_errors=True)
        raise


def check_new_file(path: str | Path, *, force: bool = False, flag: str = "--out",
                   replaceable: Callable[[Path], bool] | None = None, what: str = "file",
                   inputs: Iterable[Input | tuple] = ()) -> Path:
    """Whether a file may be written at `path`: a new one, one `replaceable(path)` recognises as
    what the command writes there (`--force` needed for it when `replaceable` is None), or any
    file with `--force`; never a folder, nor one of `inputs` or a file inside them
    (`check_not_input`), `--force` or not."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise UserError(f"{flag} {path} is a folder: give the path of the {what} to write")
    check_not_input(path, inputs, flag=flag)
    if path.exists() and not force and not (replaceable is not None and replaceable(path)):
        if replaceable is None:
            raise UserError(f"{flag} {path} exists: choose another path, or --force to replace it")
        raise UserError(f"{flag} {path} exists and is not a {what} cllm wrote: choose another path, or --force to "
                        "replace it")
    _writable(path.parent, flag)
    return path


def share_like_siblings(folder: str | Path) -> None:
    """Give the files in `folder` the permissions the user's umask gives new files (transformers
    writes model.safetensors through a private temporary file: 0600 beside 0644 siblings)."""
    umask = os.umask(0)
    os.umask(umask)
    for file in Path(folder).iterdir():
        if file.is_file() and file.stat().st_mode & 0o777 == 0o600:
            file.chmod(0o666 & ~umask)
