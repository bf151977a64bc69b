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
- a path that is a file where a folder is wanted, or a folder where a file is, or that cannot
  be written, is one line, before anything is written.

`check_folder` looks and writes nothing: commands call it for every output before their first
long stage, and `claim_folder` when they write their first file, so a run refused on a bad
input leaves no folder behind.
"""

from __future__ import annotations

import datetime
import json
import os
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path

from cllm.core import __version__
from cllm.core.errors import UserError, first_line

MARKER = ".cllm-run.json"


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


def check_folder(path: str | Path, command: str, *, force: bool | None = None, flag: str = "--out",
                 inputs: Iterable[tuple[str, str | Path | None]] = ()) -> Path:
    """Whether `command` may write into the folder `path` (see the module docstring); writes
    nothing. `inputs`: (flag, path) of what the command reads, which it must never write into;
    `force`: the command's --force (None: it has none)."""
    path = Path(path).expanduser()
    if path.exists() and not path.is_dir():
        raise UserError(f"{flag} {path} is a file, not a folder")
    for other_flag, other in inputs:
        if other and Path(other).exists() and path.exists() and path.resolve() == Path(other).resolve():
            raise UserError(f"{flag} {path} is the {other_flag} folder: choose another")
    _writable(path, flag)
    if not path.is_dir() or not any(path.iterdir()) or force:
        return path
    marker = read_marker(path)
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


def check_new_file(path: str | Path, *, force: bool = False, flag: str = "--out",
                   replaceable: Callable[[Path], bool] | None = None, what: str = "file") -> Path:
    """Whether a file may be written at `path`: a new one, one `replaceable(path)` recognises as
    what the command writes there (`--force` needed for it when `replaceable` is None), or any
    file with `--force`; never a folder."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise UserError(f"{flag} {path} is a folder: give the path of the {what} to write")
    if path.exists() and not force and not (replaceable is not None and replaceable(path)):
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
