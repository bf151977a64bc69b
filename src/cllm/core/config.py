"""Config dataclasses -> CLI flags, config files, and the resolved config written next to outputs.

Every subcommand is described by one dataclass whose fields carry their defaults and help text
(``field(default=..., metadata={"help": "..."})``) and which validates itself in
``__post_init__`` by raising ``ValueError`` with a one-line message. This module turns such a
dataclass into argparse flags (``max_new_tokens`` -> ``--max-new-tokens``), merges a
``--config FILE`` (JSON or YAML) under the command-line flags, and writes the resolved config
as JSON. It knows nothing about any particular command.

Configs may share options through dataclass inheritance: an option is declared once, in the
class whose `SECTION` (a `Section`) titles where `--help` lists it, and a command that wants
another default for an inherited option says so with `retune`.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import inspect
import json
import types
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

from cllm.core.errors import UserError, first_line, json_problem

C = TypeVar("C")


# Option text that means "nothing": `--cllm none`, `--ar-text ''`, `--out none`, `--draft-table off`.
OFF = ("", "none", "null", "false")


def is_off(value: str | None, words: Sequence[str] = OFF) -> bool:
    """Whether an option's text is one of `words` (blanks around it and case ignored); None is not.

    Each option keeps the words it has always taken: `OFF` for model and text options, fewer
    where a word could be a real file name (`--out false` writes to ./false).
    """
    return value is not None and value.strip().lower() in words


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    """(inner type, is_optional) for `X | None` / `Optional[X]`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def _list_parser(inner: Any):
    def parse(text: str) -> list:
        return [inner(part) for part in text.split(",") if part.strip() != ""]

    return parse


def _default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return f.default if f.default is not dataclasses.MISSING else None


def _nested(cls: type) -> dict[str, type]:
    """The fields of `cls` that hold a dataclass (e.g. a command's `JacobiConfig`): their own
    fields are the command's flags, as if declared in `cls` itself."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)
            if f.init and dataclasses.is_dataclass(hints[f.name])}


@dataclasses.dataclass(frozen=True)
class Section:
    """A titled block of `--help`: a config class's `SECTION` places the options it declares
    there (a field's metadata "section" places that one option elsewhere). Sections print by
    `order`, lowest first; options of no section print first, beside --help."""

    title: str
    order: int


def retune(**defaults: Any) -> Callable[[type], type]:
    """Class decorator, beneath `@dataclass`: new defaults for options the class inherits.

    An option keeps its type, help, aliases and section from the one class that declares it;
    only its default changes here (a list, dict or dataclass default is copied per instance).
    A name the class does not inherit, or declares itself, is a TypeError. The retuned names are
    kept in the class's `__retuned__`, so that `declared_fields` leaves them to their declarer.
    """

    def apply(cls: type) -> type:
        inherited: dict[str, tuple[dataclasses.Field, Any]] = {}
        for base in reversed(cls.__mro__[1:]):  # the nearest declaration wins, as in dataclasses
            if dataclasses.is_dataclass(base):
                hints = typing.get_type_hints(base)
                inherited.update({f.name: (f, hints[f.name]) for f in dataclasses.fields(base)})
        annotations = dict(inspect.get_annotations(cls))
        for name, value in defaults.items():
            if name in annotations:
                raise TypeError(f"retune({name}=...): {cls.__name__} declares {name!r} itself: default it there")
            if name not in inherited:
                raise TypeError(f"retune({name}=...): {cls.__name__} does not inherit an option {name!r}")
            f, tp = inherited[name]
            per_instance = type(value).__hash__ is None  # what dataclasses refuse as a shared default
            setattr(cls, name, dataclasses.field(
                default=dataclasses.MISSING if per_instance else value,
                default_factory=(lambda v=value: copy.deepcopy(v)) if per_instance else dataclasses.MISSING,
                init=f.init, repr=f.repr, hash=f.hash, compare=f.compare, metadata=f.metadata, kw_only=f.kw_only))
            annotations[name] = tp  # the resolved type: `cls`'s module need not know its names
        cls.__annotations__ = annotations
        cls.__retuned__ = frozenset(defaults)
        return cls

    return apply


def declared_fields(cls: type) -> set[str]:
    """The fields `cls` declares itself: its own annotations, less class variables and the
    options it only retunes (`retune`)."""
    if not dataclasses.is_dataclass(cls):
        return set()
    names = {f.name for f in dataclasses.fields(cls)}
    return (set(inspect.get_annotations(cls)) & names) - set(vars(cls).get("__retuned__", ()))


def _declaring_classes(cls: type) -> list[type]:
    """`cls` and its bases in reading order: each class's bases as listed (recursively), then
    the class itself. --help lists a section's options in this order."""
    order: list[type] = []

    def visit(klass: type) -> None:
        for base in klass.__bases__:
            visit(base)
        if klass not in order:
            order.append(klass)

    visit(cls)
    return order


def _option_rows(cls: type, defaults: Any, outer: Section | None) -> list[tuple]:
    """(section, field, type, default shown) of each flag of `cls`, in reading order; a nested
    dataclass field (see `_nested`) gives its fields' rows where it stands, in their own
    sections (default: the section of the field holding them)."""
    hints = typing.get_type_hints(cls)
    nested = _nested(cls)
    classes = _declaring_classes(cls)
    declarer = {name: klass for klass in classes for name in declared_fields(klass)}  # the nearest wins
    position = {f.name: i for i, f in enumerate(dataclasses.fields(cls))}
    rows: list[tuple] = []
    for f in sorted(dataclasses.fields(cls), key=lambda f: (classes.index(declarer.get(f.name, cls)),
                                                            position[f.name])):
        if not f.init or f.metadata.get("cli") is False:
            continue
        section = f.metadata.get("section") or vars(declarer.get(f.name, cls)).get("SECTION") or outer
        if f.name in nested:
            rows += _option_rows(nested[f.name], _default(f), section)
            continue
        rows.append((section, f, hints[f.name], getattr(defaults, f.name) if defaults is not None else _default(f)))
    return rows


def add_dataclass_arguments(parser: argparse.ArgumentParser, cls: type, defaults: Any = None) -> None:
    """Add one optional flag per dataclass field (a nested dataclass field adds its fields'
    flags), in an argument group per `Section` (see the module notes). Defaults stay
    None so that a config file can fill what the command line leaves unset; the dataclass
    supplies the real defaults. `defaults`: an instance whose values the help shows."""
    rows = _option_rows(cls, defaults, None)
    groups: dict[Section, Any] = {}
    for section, f, tp, default in sorted(rows, key=lambda row: row[0].order if row[0] else float("-inf")):
        if section is None:
            container = parser
        else:
            if section not in groups:
                groups[section] = parser.add_argument_group(section.title)
            container = groups[section]
        _add_flag(container, f, tp, default)


def _add_flag(container: Any, f: dataclasses.Field, tp: Any, default: Any) -> None:
    """The flag of field `f` (`--max-new-tokens`, its short and old names too), typed from `tp`."""
    tp, _ = _unwrap_optional(tp)
    help_text = f.metadata.get("help", "")
    if "(default" not in help_text:  # a help text that explains its default says it once
        help_text = f"{help_text} (default: {default})" if help_text else f"(default: {default})"
    # argparse formats help with %: a literal "3%" would break `--help`
    kwargs: dict[str, Any] = {"dest": f.name, "default": None, "help": help_text.replace("%", "%%")}
    if f.metadata.get("positional"):  # `cllm import FILE`: the one input a command takes without a flag
        kwargs.pop("dest")
        container.add_argument(f.name, nargs="?", metavar=f.metadata.get("metavar"), **kwargs)
        return
    if typing.get_origin(tp) is typing.Literal:
        choices = typing.get_args(tp)
        kwargs.update(type=type(choices[0]), choices=choices)
    elif tp is bool:
        kwargs.update(type=_parse_bool, nargs="?", const=True, metavar="BOOL")
    elif typing.get_origin(tp) in (list, tuple):
        inner = typing.get_args(tp)[0] if typing.get_args(tp) else str
        kwargs.update(type=_list_parser(inner), metavar="A,B,...")
    elif tp in (int, float, str):
        kwargs.update(type=tp)
    else:
        kwargs.update(type=str)
    short = [f.metadata["short"]] if "short" in f.metadata else []  # e.g. -v beside --verbose
    old = [_flag(a) for a in f.metadata.get("aliases", ())]  # a renamed option's old names still work
    if old:
        kwargs["help"] += f" ({', '.join(old)}: its old name, deprecated)"
    container.add_argument(*short, _flag(f.name), *old, **kwargs)


def field_aliases(cls: type) -> dict[str, str]:
    """Old option name -> its field, for the fields of `cls` renamed since (metadata "aliases"):
    config files and resumed runs that still say the old name."""
    return {alias: f.name for f in dataclasses.fields(cls) for alias in f.metadata.get("aliases", ())}


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Read a JSON or YAML mapping; a missing or malformed file is a UserError."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"config file not found: {path}")
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix.lower() in (".yaml", ".yml"):
            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"cannot parse config file {path}: {json_problem(exc)}") from None
    except Exception as exc:  # noqa: BLE001 - any parse error is the user's file
        raise UserError(f"cannot parse config file {path}: {first_line(exc)}") from None
    if not isinstance(data, dict):
        raise UserError(f"config file {path} must hold a mapping of option names to values")
    return data


def build_config(cls: type[C], file_values: dict[str, Any] | None, cli_values: dict[str, Any]) -> C:
    """Defaults < config file < command line. Unknown keys in the file are an error. Keys are
    flat: a nested dataclass field (see `_nested`) is built from its own fields' keys."""
    nested = _nested(cls)
    owner = {f.name: None for f in dataclasses.fields(cls) if f.init and f.name not in nested}
    for name, sub in nested.items():
        owner.update({f.name: name for f in dataclasses.fields(sub) if f.init})
    values: dict[str, Any] = {}
    renamed = field_aliases(cls)
    for key, value in (file_values or {}).items():
        key = key.replace("-", "_")
        key = renamed.get(key, key)
        if key not in owner:
            raise UserError(f"unknown option {key!r} in config file")
        values[key] = value
    values.update({k: v for k, v in cli_values.items() if k in owner and v is not None})
    grouped = {k: v for k, v in values.items() if owner[k] is None}
    defaults = {f.name: _default(f) for f in dataclasses.fields(cls) if f.name in nested}
    try:
        for name in nested:
            own = {k: v for k, v in values.items() if owner[k] == name}
            if own:
                grouped[name] = dataclasses.replace(defaults[name], **own)
        return cls(**grouped)
    except TypeError as exc:
        raise UserError(str(exc)) from None


def config_to_dict(config: Any) -> dict[str, Any]:
    def plain(value: Any) -> Any:
        if isinstance(value, Path):
            return str(value)
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return value

    flat: dict[str, Any] = {}
    for f in dataclasses.fields(config):  # a nested dataclass's fields sit beside the others
        value = getattr(config, f.name)
        flat.update(config_to_dict(value) if dataclasses.is_dataclass(value) else {f.name: plain(value)})
    return flat


def write_config(config: Any, path: str | Path) -> Path:
    """Write the resolved config as JSON (the record of what produced an artifact)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config_to_dict(config), indent=2, sort_keys=True) + "\n")
    return path
