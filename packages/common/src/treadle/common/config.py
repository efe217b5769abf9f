"""Typed configuration and the generated command line: the base every treadle CLI is built on.

A configuration is a tree of frozen, slotted, keyword-only dataclasses declared with
``@configclass``; each field has a docstring (it becomes the ``--help`` text) and each class
validates itself in ``__post_init__`` by raising ``ConfigError``. ``parse(cls, argv)`` turns a
command line into such a tree with tyro: flags are dotted paths with underscores kept
(``--actor.model_name_or_path X``, ``--ds.zero_stage 3``), booleans are bare switches
(``--train.colocate_all``, and ``--train.no_colocate_all`` to turn one off), tuples take several
values (``--algo.advantage.is_correction_threshold 0.5 5.0``), ``X | None`` accepts ``None``.

``--config FILE.yaml`` loads a (partial) tree from YAML as the defaults; flags given on the
command line override it. ``dump_yaml`` writes the resolved tree of a run and ``load_yaml``
reads it back equal. ``renamed`` maps retired flags to their new names: using one is an error
that names the replacement (a user's flag is never rewritten silently); it may also map a flag
to the reason it is refused (a feature not supported). Other spellings that are accepted are
declared on their field: ``alias`` (another name of the flag) and ``value_alias`` (a switch that
sets the field to one value, as OpenRLHF's ``--model.ipo_enable`` sets ``--actor.loss_type ipo``).

Validation runs once, on the finished tree: while tyro and the YAML loader assemble it, the
``__post_init__`` checks are deferred, then ``validate`` runs them bottom-up (groups first, then
the cross-group checks of their parents) and qualifies the flags an error names, so a message
from a group reads ``--ds.zero_stage must be 0, 1, 2 or 3, got 5`` wherever the group sits.

Not here: the trees themselves (each package owns its own, e.g. ``treadle.trainer.config``) and
environment knobs (``treadle.common.env``). No torch; tyro is imported only when parsing.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import difflib
import functools
import re
import sys
import types
import typing
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

try:
    from typing import dataclass_transform
except ImportError:  # Python 3.10: type checkers lose the dataclass view, nothing else changes
    def dataclass_transform(**_: Any) -> Any:
        return lambda f: f

T = TypeVar("T")
CONFIG_FLAG = "--config"
"""The flag that names a YAML file of defaults; handled here, not by tyro."""
_REDACTED = None  # what a secret field becomes in a dump

_defer = contextvars.ContextVar("treadle_config_defer_validation", default=False)


class ConfigError(ValueError):
    """An invalid value or combination; the message names the flag(s) (``--group.field``) and value.

    Raised inside a group's ``__post_init__`` with flags relative to that group
    (``"--zero_stage must be ..."``); ``validate`` rewrites them to full paths.
    """


@dataclass_transform(frozen_default=True, kw_only_default=True)
def configclass(cls: type[T]) -> type[T]:
    """``@dataclass(frozen=True, slots=True, kw_only=True)`` whose ``__post_init__`` can be deferred.

    Write a plain ``__post_init__`` that raises ``ConfigError``; it runs on direct construction,
    and is postponed (then run by ``validate``) while ``parse`` / ``from_dict`` assemble a tree.
    Slotted classes cannot use zero-argument ``super()``: call ``Base.__post_init__(self)``.
    """
    check = cls.__dict__.get("__post_init__")
    if check is not None:

        @functools.wraps(check)
        def __post_init__(self: Any) -> None:
            if not _defer.get():
                check(self)

        cls.__post_init__ = __post_init__  # type: ignore[attr-defined]
    return dataclasses.dataclass(frozen=True, slots=True, kw_only=True)(cls)


def secret(default: Any = None) -> Any:
    """A field that ``dump_yaml`` writes as null (API keys, tokens): run directories get shared."""
    return dataclasses.field(default=default, metadata={"secret": True})


def alias(*names: str) -> Any:
    """``Annotated`` metadata: extra spellings of a flag (``alias("--prompt_max_len")``), shown in --help."""
    import tyro  # noqa: PLC0415  (only modules that declare aliases pay for tyro)

    return tyro.conf.arg(aliases=names)


@dataclasses.dataclass(frozen=True, slots=True)
class ValueAlias:
    """``Annotated`` metadata made by ``value_alias``: ``flag`` alone means this field is ``value``."""

    flag: str
    value: str


def value_alias(flag: str, value: str) -> Any:
    """``Annotated`` metadata: the bare switch ``flag`` is another spelling of this field set to ``value``.

    For a store-true flag of OpenRLHF that picks one value of a treadle choice
    (``value_alias("--model.ipo_enable", "ipo")`` on DPO's ``loss_type``). ``parse`` spells it out
    as the field's own flag and value before tyro reads the line, so validation messages name the
    field's flag; ``flag_names`` lists it. --help shows the field, not the switch: say it in the
    field's docstring.
    """
    return ValueAlias(flag, value)


def switch_only() -> Any:
    """``Annotated`` metadata: a boolean without the ``--no_`` twin (for names that already negate)."""
    import tyro  # noqa: PLC0415

    return tyro.conf.FlagCreatePairsOff


@contextlib.contextmanager
def deferred_validation() -> Iterator[None]:
    """Within this block ``@configclass`` constructors skip their ``__post_init__`` checks."""
    token = _defer.set(True)
    try:
        yield
    finally:
        _defer.reset(token)


# ---------------------------------------------------------------------------------------------
# Validation


def _nodes(cfg: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(flag prefix, node) for every config node, children before their parent."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            yield from _nodes(value, f"{prefix}{f.name}.")
    yield prefix, cfg


_FLAG = re.compile(r"(?<![\w.-])--([A-Za-z_]\w*)")


def _qualify(message: str, prefix: str, names: set[str]) -> str:
    """Prefix every ``--name...`` in ``message`` whose first part is one of ``names``."""
    if not prefix:
        return message
    return _FLAG.sub(lambda m: f"--{prefix}{m.group(1)}" if m.group(1) in names else m.group(0), message)


def validate(cfg: T) -> T:
    """Run every node's ``__post_init__`` checks, children first; ``ConfigError`` names full flags."""
    for prefix, node in _nodes(cfg):
        check = getattr(type(node), "__post_init__", None)
        if check is None:
            continue
        try:
            check(node)
        except ConfigError as e:
            names = {f.name for f in dataclasses.fields(node)}
            raise ConfigError(_qualify(str(e), prefix, names)) from None
    return cfg


# ---------------------------------------------------------------------------------------------
# dict / YAML


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, include_extras=True)


def _strip(tp: Any) -> Any:
    while typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    return tp


def to_dict(cfg: Any, *, redact: bool = False) -> dict[str, Any]:
    """The tree as plain YAML-able data (tuples become lists); secrets become None when ``redact``."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if redact and f.metadata.get("secret") and value is not None:
            value = _REDACTED
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            value = to_dict(value, redact=redact)
        elif isinstance(value, tuple):
            value = list(value)
        out[f.name] = value
    return out


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(tp: Any, value: Any, where: str) -> Any:
    """``value`` (from YAML) checked and converted to annotation ``tp``; ConfigError otherwise."""
    tp = _strip(tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{where}={value!r}: expected one of {list(args)}")
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arm in (a for a in args if a is not type(None)):
            try:
                return _coerce(arm, value, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{where}={value!r}: expected {_type_name(tp)}")
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}={value!r}: expected a list")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise ConfigError(f"{where}={value!r}: expected {len(args)} values")
        return tuple(_coerce(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value, strict=True)))
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}={value!r}: expected true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}={value!r}: expected an integer")
        return value
    if tp is float:
        # PyYAML reads ``1e-6`` (no dot) as a string: accept any spelling float() accepts.
        if isinstance(value, bool):
            raise ConfigError(f"{where}={value!r}: expected a number")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}={value!r}: expected a number") from None
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}={value!r}: expected a string")
        return value
    if tp is Path:
        return Path(value)
    raise ConfigError(f"{where}: cannot read a {_type_name(tp)} from YAML")


def _expand_dotted(data: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``{"actor.adam.lr": 1e-6}`` -> ``{"actor": {"adam": {"lr": 1e-6}}}`` (merged with nested maps)."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if not isinstance(key, str):
            raise ConfigError(f"{where}: keys must be strings, got {key!r}")
        head, _, rest = key.partition(".")
        if rest:
            value = {rest: value}
        if isinstance(value, Mapping) and isinstance(out.get(head), dict):
            value = {**out[head], **_expand_dotted(value, where)}
        out[head] = value
    return out


def from_dict(cls: type[T], data: Mapping[str, Any], *, base: T | None = None, check: bool = True,
              where: str = "") -> T:
    """A ``cls`` tree from nested (or dotted-key) data; missing keys keep ``base``'s values (or defaults).

    Unknown keys and values of the wrong type raise ``ConfigError`` naming the key path. With
    ``check=False`` the result is not validated (``parse`` uses it for YAML defaults that the
    command line may still complete).
    """
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {type(data).__name__}")
    data = _expand_dotted(data, where or "config")
    with deferred_validation():
        node = cls() if base is None else base
        hints, names = _hints(cls), [f.name for f in dataclasses.fields(cls)]
        changes: dict[str, Any] = {}
        for key, value in data.items():
            path = f"{where}.{key}" if where else key
            if key not in names:
                near = difflib.get_close_matches(key, names, n=1)
                hint = f"; did you mean {near[0]!r}?" if near else f"; known: {', '.join(names)}"
                raise ConfigError(f"unknown config key {path!r}{hint}")
            tp = _strip(hints[key])
            if isinstance(tp, type) and dataclasses.is_dataclass(tp):
                changes[key] = from_dict(tp, value or {}, base=getattr(node, key), check=False, where=path)
            else:
                changes[key] = _coerce(tp, value, path)
        node = dataclasses.replace(node, **changes)
    return validate(node) if check else node


def dump_yaml(cfg: Any, path: str | Path | None = None, *, redact: bool = True) -> str:
    """The resolved tree as YAML (written to ``path`` too when given); secrets are nulled by default."""
    text = yaml.safe_dump(to_dict(cfg, redact=redact), sort_keys=False, allow_unicode=True)
    if path is not None:
        Path(path).write_text(text, encoding="utf-8")
    return text


def load_yaml(cls: type[T], source: str | Path, *, check: bool = True) -> T:
    """Inverse of ``dump_yaml``: ``source`` is a file path, or YAML text if it contains a newline."""
    inline = isinstance(source, str) and "\n" in source
    text = source if inline else _read(Path(source))
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{'YAML text' if inline else source}: not valid YAML: {e}") from None
    return from_dict(cls, data or {}, check=check)


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"{CONFIG_FLAG} {path}: cannot read it ({e.strerror})") from None


# ---------------------------------------------------------------------------------------------
# Command line


def find_flag(args: Sequence[str], names: Mapping[str, object]) -> tuple[str, str] | None:
    """The first flag of ``args`` (before ``--``) that ``names`` holds, as ``(typed, key)``: the
    spelling typed and its underscore form (tyro accepts ``-`` and ``_``); None when there is none."""
    for arg in args:
        if arg == "--":
            break
        name = arg.split("=", 1)[0]
        key = "--" + name[2:].replace("-", "_") if name.startswith("--") else name
        if key in names:
            return name, key
    return None


def check_renamed(args: Sequence[str], renamed: Mapping[str, str]) -> None:
    """Raise ``ConfigError`` if ``args`` use a retired flag; the message names its replacement.

    A value that is no flag (does not start with ``--``) is the reason a flag is refused outright
    (a feature not supported, with nothing to use instead): the message is the flag and that reason.
    """
    if (found := find_flag(args, renamed)) is None:
        return
    name, key = found
    target = renamed[key]
    if not target.startswith("--"):
        raise ConfigError(f"{name}: {target}")
    raise ConfigError(f"{name} was renamed: use {target} instead")


def _split_config(args: Sequence[str]) -> tuple[str | None, list[str]]:
    """(the ``--config`` file or None, the other arguments)."""
    rest: list[str] = []
    found: list[str] = []
    it = iter(args)
    for arg in it:
        if arg == CONFIG_FLAG:
            value = next(it, None)
            if value is None or value.startswith("--"):
                raise ConfigError(f"{CONFIG_FLAG} needs a YAML file path")
            found.append(value)
        elif arg.startswith(CONFIG_FLAG + "="):
            found.append(arg.split("=", 1)[1])
        else:
            rest.append(arg)
    if len(found) > 1:
        raise ConfigError(f"{CONFIG_FLAG} given {len(found)} times ({', '.join(found)}); give one file")
    return (found[0] if found else None), rest


def _description(cls: type, description: str | None) -> str:
    head = description or (cls.__doc__ or "").strip()
    return f"{head}\n\nDefaults may come from a YAML file: {CONFIG_FLAG} FILE.yaml (flags override it)."


def parse(cls: type[T], args: Sequence[str] | None = None, *, prog: str | None = None,
          description: str | None = None, renamed: Mapping[str, str] = types.MappingProxyType({})) -> T:
    """A validated ``cls`` tree from ``args`` (``sys.argv[1:]`` when None).

    Raises ``ConfigError`` for retired flags, unreadable ``--config`` files and invalid values or
    combinations; malformed flags (unknown names, wrong types, bad choices) make tyro print an
    error naming the flag and exit with status 2, and ``--help`` prints and exits 0.
    """
    import tyro  # noqa: PLC0415

    argv = list(sys.argv[1:] if args is None else args)
    check_renamed(argv, renamed)
    config_file, argv = _split_config(argv)
    argv = _spell_value_aliases(cls, argv)
    argv = _bare_tri_state(cls, argv)
    with deferred_validation():
        default = load_yaml(cls, Path(config_file), check=False) if config_file else cls()
        cfg = tyro.cli(cls, args=argv, prog=prog, description=_description(cls, description),
                       default=default, use_underscores=True)
    return validate(cfg)


def _value_aliases(cls: type, prefix: str = "") -> dict[str, tuple[str, str]]:
    """``value_alias`` switches of the tree of ``cls`` -> (the field's flag, the value)."""
    out: dict[str, tuple[str, str]] = {}
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if typing.get_origin(tp) is typing.Annotated:
            for meta in tp.__metadata__:
                if isinstance(meta, ValueAlias):
                    _add_value_alias(out, meta.flag, (f"--{prefix}{f.name}", meta.value))
        inner = _strip(tp)
        if isinstance(inner, type) and dataclasses.is_dataclass(inner):
            for flag, target in _value_aliases(inner, f"{prefix}{f.name}.").items():
                _add_value_alias(out, flag, target)
    return out


def _add_value_alias(out: dict[str, tuple[str, str]], flag: str, target: tuple[str, str]) -> None:
    if flag in out:  # e.g. a group holding one used at two places of the tree
        raise TypeError(f"value_alias {flag} is declared on both {out[flag][0]} and {target[0]}")
    out[flag] = target


def _spell_value_aliases(cls: type, argv: list[str]) -> list[str]:
    """``argv`` with each ``value_alias`` switch replaced by its field's flag and value."""
    aliases = _value_aliases(cls)
    out: list[str] = []
    for i, arg in enumerate(argv):
        if arg == "--":
            return out + argv[i:]
        name, eq, _ = arg.partition("=")
        key = "--" + name[2:].replace("-", "_") if name.startswith("--") else name
        if key not in aliases:
            out.append(arg)
            continue
        flag, value = aliases[key]
        if eq:
            raise ConfigError(f"{name} is a switch (it means {flag} {value}): give it alone, without a value")
        out += [flag, value]
    return out


def _bare_tri_state(cls: type, argv: list[str]) -> list[str]:
    """OpenRLHF's store-true spelling for the tri-state (``bool | None``) flags, which take a
    value: ``--ds.overlap_comm`` alone (last, or followed by another flag) means ``... True``."""
    bare = {i for i, a in enumerate(argv)
            if a.startswith("--") and "=" not in a and (i + 1 == len(argv) or argv[i + 1].startswith("--"))}
    if not bare:
        return argv
    tri = _tri_state_flags(cls)
    out: list[str] = []
    for i, a in enumerate(argv):
        out.append(a)
        if i in bare and a in tri:
            out.append("True")
    return out


def _tri_state_flags(cls: type) -> set[str]:
    """The option strings of ``cls``'s command line whose value is one of None / True / False."""
    return {s for action in _parser_actions(cls) if action.nargs != 0 and action.choices
            and {"True", "False"} <= set(map(str, action.choices)) for s in action.option_strings}


def _parser_actions(cls: type) -> list[Any]:
    import tyro  # noqa: PLC0415

    with deferred_validation(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # get_parser is marked deprecated; it is the public way in
        parser = tyro.extras.get_parser(cls, default=cls(), use_underscores=True)
    return list(parser._actions)


def flag_names(cls: type) -> list[str]:
    """Every option string the command line of ``cls`` accepts (aliases, value aliases, ``--no_*``,
    ``--config``), sorted."""
    names = {s for action in _parser_actions(cls) for s in action.option_strings}
    return sorted(names | set(_value_aliases(cls)) | {CONFIG_FLAG})


def label_selector(labels: Sequence[str]) -> dict[str, str]:
    """``("role=trainer", "zone=!b")`` -> ``{"role": "trainer", "zone": "!b"}``: a Ray label selector
    (``bundle_label_selector``), matched against the labels nodes got from ``ray start --labels``.

    Values are Ray's selector syntax, passed on as they are: ``v`` (equal), ``!v`` (not equal),
    ``in(a,b)``, ``!in(a,b)``. ConfigError for an item that is not KEY=VALUE or a key given twice.
    """
    out: dict[str, str] = {}
    for item in labels:
        key, eq, value = item.partition("=")
        if not eq or not key.strip() or not value.strip():
            raise ConfigError(f"--node_labels {item!r}: each label is KEY=VALUE (as `ray start --labels KEY=VALUE`)")
        if key in out:
            raise ConfigError(f"--node_labels: label {key!r} given twice")
        out[key.strip()] = value.strip()
    return out
