"""`cllm import`: a GGUF file (llama.cpp's format, quantized or not) as a checkpoint folder the
torch side loads like any other (`load_model`, `load_tokenizer`): decodes on the torch runtimes,
trains, collects, exports again.

transformers reads a GGUF itself (`from_pretrained(folder, gguf_file=name)`: every tensor
dequantized to float32, the config and the tokenizer, chat template included, rebuilt from the
file's metadata; it needs the `gguf` package), but will not save what it read
(`save_pretrained` refuses a model "quantized with gguf"). So the folder is written here: the
state dict as safetensors (one copy of tied weights: SmolLM2's lm_head is its embedding), the
config without its quantization marker, a generation config whose EOS ids are the file's
end-of-generation tokens, the tokenizer, and a README naming the file and its sha256.

Everything is written into a temporary folder beside `--out` (`.OUT.*.partial`) and renamed
into place at the end: a killed import leaves no folder that looks whole.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from cllm.core.errors import UserError, first_line
from cllm.core.outputs import (
    MARKER,
    Input,
    check_folder,
    claim_folder,
    read_marker,
    share_like_siblings,
    write_failures,
)
from cllm.models.import_config import ImportConfig
from cllm.models.loading import resolve_dtype
from cllm.runtime.gguf import import_gguf

log = logging.getLogger(__name__)

COMMAND = "import"
MAGIC = b"GGUF"  # the first four bytes of every GGUF file
WEIGHTS = "model.safetensors"
# the metadata keys naming the tokens that end a generation (llama.cpp's EOS, EOT, EOM)
END_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass(frozen=True)
class ImportJob:
    """What `cllm import` reads and writes, checked (`check_import`) before anything loads."""

    gguf: Path
    out: Path
    dtype: torch.dtype
    force: bool


@dataclass(frozen=True)
class ImportSummary:
    """What an import wrote."""

    out: Path
    architecture: str
    parameters: int
    dtype: str
    end_ids: tuple[int, ...]
    sha256: str

    def line(self) -> str:
        return (f"wrote {self.out}/: a {self.architecture} checkpoint of {self.parameters / 1e6:.1f}M parameters in "
                f"{self.dtype}, EOS ids {list(self.end_ids)} (load it as --model {self.out})")


def check_gguf_file(path: str | os.PathLike) -> Path:
    """`path` when it is a GGUF file, else a one-line UserError saying what it is."""
    file = Path(path).expanduser()
    if file.is_dir():
        raise UserError(f"{path} is a folder, not a GGUF file")
    if not file.exists():
        raise UserError(f"no GGUF file at {path}")
    try:
        with file.open("rb") as f:
            head = f.read(len(MAGIC))
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror or first_line(exc)}") from None
    if head != MAGIC:
        raise UserError(f"{path} is not a GGUF file (it does not start with {MAGIC.decode()})")
    return file


def check_import(config: ImportConfig) -> ImportJob:
    """The input file, the output folder and the gguf package, checked in that order before
    anything loads; one line for the first problem."""
    gguf = check_gguf_file(config.file)
    out = check_folder(config.out, COMMAND, force=config.force, flag="--out", inputs=[Input("GGUF", gguf)])
    if out.is_dir() and any(out.iterdir()) and not config.force:  # an earlier import's, whole
        raise UserError(f"--out {out} holds an earlier cllm import: choose a new folder, or --force to replace it")
    import_gguf()  # a missing package in one line, with what to install
    return ImportJob(gguf=gguf, out=out, dtype=resolve_dtype(config.dtype), force=config.force)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def end_of_generation(path: Path) -> tuple[tuple[int, ...], str | None]:
    """The ids of the tokens that end a generation in the GGUF's metadata (EOS, EOT, EOM, in
    that order, each once) and its `general.name` (None when it has none)."""
    try:
        reader = import_gguf().GGUFReader(str(path))
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - a damaged or truncated file: whatever the reader raises
        raise UserError(f"cannot read {path}: {first_line(exc)}") from None
    ids: list[int] = []
    for key in END_KEYS:
        found = reader.get_field(key)
        if found is not None and int(found.contents()) not in ids:
            ids.append(int(found.contents()))
    name = reader.get_field("general.name")
    return tuple(ids), (str(name.contents()) if name is not None else None)


@contextmanager
def _alone(gguf: Path) -> Iterator[tuple[str, str]]:
    """(folder, file name) for transformers' `gguf_file=`: a link to the file in a folder of its
    own, so that no config.json or tokenizer lying beside the GGUF is read in its place."""
    with tempfile.TemporaryDirectory(prefix="cllm-import-") as scratch:
        link = Path(scratch) / "model.gguf"
        try:
            link.symlink_to(gguf.resolve())
        except OSError:  # no links here: read it where it lies
            yield str(gguf.parent), gguf.name
            return
        yield scratch, link.name


def read_gguf(gguf: Path):
    """The GGUF's model (dequantized, float32, eval mode) and tokenizer, as transformers builds
    them; what transformers cannot read (an architecture it does not know) in one line."""
    with _alone(gguf) as (folder, name):
        try:
            model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        except Exception as exc:  # noqa: BLE001 - an architecture it does not know, a damaged tensor
            raise UserError(f"transformers cannot read {gguf}: {first_line(exc)}") from None
    return model.eval(), tokenizer


def plain_state_dict(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The model's weights in `dtype`, each tensor once: a weight sharing its storage with one
    before it (a tied lm_head) is left out, as `save_pretrained` leaves it, and tied again on
    load by the config's `tie_word_embeddings`."""
    seen: set[tuple[int, tuple[int, ...]]] = set()
    weights = {}
    for name, tensor in model.state_dict().items():
        key = (tensor.data_ptr(), tuple(tensor.shape))
        if key in seen:
            continue
        seen.add(key)
        weights[name] = tensor.detach().to(dtype).contiguous()
    return weights


def plain_config(model: torch.nn.Module, dtype: torch.dtype):
    """The model's config as an ordinary checkpoint's: no quantization marker (with it, loading
    would look for the GGUF), its class as the architecture, the dtype written."""
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(model).__name__]
    config.dtype = dtype
    return config


def _readme(job: ImportJob, sha256: str, title: str | None, config) -> str:
    return (f"# {job.out.name}\n\n"
            f"Imported by `cllm import` from the GGUF file `{job.gguf.name}`"
            f"{f' ({title})' if title else ''}, sha256 `{sha256}`: its weights dequantized by transformers "
            f"and written in {DTYPE_NAMES.get(job.dtype, str(job.dtype))}, with its tokenizer and chat template. "
            f"A {config.model_type} model; its license and authors are the GGUF's.\n")


def write_checkpoint(job: ImportJob, folder: Path, model, tokenizer, *, end_ids: tuple[int, ...], sha256: str,
                     title: str | None) -> None:
    """The checkpoint files into `folder` (the temporary one)."""
    claim_folder(folder, COMMAND)
    save_file(plain_state_dict(model, job.dtype), str(folder / WEIGHTS), metadata={"format": "pt"})
    config = plain_config(model, job.dtype)
    config.save_pretrained(folder)
    generation = GenerationConfig(bos_token_id=config.bos_token_id, pad_token_id=config.pad_token_id,
                                  eos_token_id=list(end_ids) if len(end_ids) > 1 else
                                  (end_ids[0] if end_ids else config.eos_token_id))
    generation.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "README.md").write_text(_readme(job, sha256, title, config), encoding="utf-8")


def _share(folder: Path) -> None:
    """The permissions the user's umask gives a new folder and its files (a temporary folder is
    private)."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    share_like_siblings(folder)


def _publish(folder: Path, out: Path) -> None:
    """Move the finished `folder` to `out`: renamed into place when `out` is new or empty, or in
    place of an earlier import there; file by file into a folder of other files (--force)."""
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        if out.exists():
            out.rmdir()
        folder.rename(out)
        return
    if (read_marker(out) or {}).get("command") == COMMAND:  # an earlier import: swap, then drop it
        old = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".old"))
        old.rmdir()
        out.rename(old)
        folder.rename(out)
        shutil.rmtree(old, ignore_errors=True)
        return
    for file in folder.iterdir():  # --force into the user's folder: ours replace, theirs stay
        if file.name != MARKER or not (out / MARKER).exists():
            os.replace(file, out / file.name)
    shutil.rmtree(folder, ignore_errors=True)


def import_checkpoint(job: ImportJob) -> ImportSummary:
    """Read the GGUF with transformers and write it at `job.out` as a checkpoint folder."""
    sha256 = sha256_of(job.gguf)
    end_ids, title = end_of_generation(job.gguf)
    model, tokenizer = read_gguf(job.gguf)
    with write_failures(job.out):
        job.out.parent.mkdir(parents=True, exist_ok=True)
        folder = Path(tempfile.mkdtemp(dir=job.out.parent, prefix=f".{job.out.name}.", suffix=".partial"))
        try:
            write_checkpoint(job, folder, model, tokenizer, end_ids=end_ids, sha256=sha256, title=title)
            _share(folder)
            _publish(folder, job.out)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    log.info("imported %s into %s", job.gguf, job.out)
    return ImportSummary(out=job.out, architecture=type(model).__name__,
                         parameters=sum(p.numel() for p in model.parameters()),
                         dtype=DTYPE_NAMES.get(job.dtype, str(job.dtype)), end_ids=end_ids, sha256=sha256)
