"""What chatting needs from a model's tokenizer, checked once when it loads: its chat template
(untrusted input: a model's files are someone else's text) and the ids that end a turn.

A chat template is Jinja that transformers renders in its sandboxed environment
(`transformers.utils.chat_template_utils`, which both a Hugging Face tokenizer and
`LlamaCppTokenizer` call): one that reaches for Python's internals is stopped there, never run.
`check_chat_template` renders a probe conversation at load, so that a template the sandbox
blocks, that is not Jinja, or that cannot write a plain conversation is refused in one line
naming where it came from, before a chat or a server starts, not at the first request.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import huggingface_hub
from jinja2.exceptions import SecurityError, TemplateSyntaxError

from cllm.core.errors import UserError, first_line
from cllm.decoding.inputs import eos_set

log = logging.getLogger(__name__)

# system + user + assistant + user, answered next: what `cllm chat` and a chat completion send
PROBE = (
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hello!"},
    {"role": "assistant", "content": "Hello. How can I help?"},
    {"role": "user", "content": "What is 2 + 2?"},
)


def check_chat_template(tokenizer, where: str) -> None:
    """Refuse `tokenizer`'s chat template (found in `where`, said in the error) in one line when
    the sandbox blocks it, when it is not Jinja, or when it cannot write the probe conversation
    (with the generation prompt) with nor without its system message (some templates refuse a
    system role, Gemma's); a tokenizer without a template passes."""
    if not getattr(tokenizer, "chat_template", None):
        return
    problem = ""
    for probe in (PROBE, PROBE[1:]):
        try:
            text = tokenizer.apply_chat_template(list(probe), tokenize=False, add_generation_prompt=True)
        except SecurityError as exc:  # the sandbox stopped it: `''.__class__`, `cycler.__init__`...
            raise UserError(f"the chat template in {where} is refused: it reaches for Python's internals, which the "
                            f"sandbox forbids ({first_line(exc)})") from None
        except TemplateSyntaxError as exc:
            raise UserError(f"the chat template in {where} is not valid Jinja (line {exc.lineno}: "
                            f"{first_line(exc)})") from None
        except Exception as exc:  # noqa: BLE001 - whatever the template raises (raise_exception, a type error)
            problem = problem or f"{type(exc).__name__}: {first_line(exc)}"
            continue
        if isinstance(text, str):
            return
        problem = problem or f"it wrote a {type(text).__name__}, not text"
    raise UserError(f"the chat template in {where} cannot write a conversation (system, user, assistant, user): "
                    f"{problem}")


def template_source(folder: str | Path) -> str:
    """Where a Hugging Face tokenizer loaded from `folder` (or a hub id) took its chat template
    from, for error messages: transformers prefers chat_template.jinja, then
    chat_template.json, then tokenizer_config.json's "chat_template"."""
    path = Path(folder)
    if not path.is_dir():
        return f"the tokenizer_config.json of {folder}"
    for name in ("chat_template.jinja", "chat_template.json"):
        if (path / name).is_file():
            return str(path / name)
    return str(path / "tokenizer_config.json")


def end_of_turn_ids(tokenizer) -> frozenset[int]:
    """The ids a reply ends at: the tokenizer's EOS; for a GGUF's own tokenizer, every id
    llama.cpp ends generation at (`LlamaCppTokenizer.eos_token_ids`); for a Hugging Face one,
    the eos ids of the generation_config.json beside it too (a chat model's end of turn,
    `<|im_end|>` or `<|eot_id|>`, where its tokenizer's EOS is another token)."""
    ids = set(eos_set(tokenizer.eos_token_id)) | set(eos_set(getattr(tokenizer, "eos_token_ids", None)))
    return frozenset(ids | _generation_config_eos(str(getattr(tokenizer, "name_or_path", "") or "")))


def _generation_config_eos(folder: str) -> set[int]:
    """The eos ids of the generation_config.json in `folder` (or cached for a hub id); none when
    there is none. One that cannot be read is said in the log and left out: the model decodes,
    stopping at its tokenizer's EOS."""
    if not folder:
        return set()
    file: Path | str | None = Path(folder).expanduser() / "generation_config.json"
    if not Path(file).is_file():
        file = None if Path(folder).expanduser().exists() else _cached(folder)
    if file is None:
        return set()
    try:
        eos = json.loads(Path(file).read_text(encoding="utf-8")).get("eos_token_id")
        return set(eos_set(eos))
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        log.warning("cannot read the eos ids of %s (%s): generation stops at the tokenizer's EOS only",
                    file, first_line(exc))
        return set()


def _cached(repo_id: str) -> str | None:
    """A hub model's generation_config.json when the hub cache holds it (no download)."""
    try:
        found = huggingface_hub.try_to_load_from_cache(repo_id, "generation_config.json")
    except Exception:  # noqa: BLE001 - not a hub id (a name huggingface_hub refuses)
        return None
    return found if isinstance(found, str) else None
