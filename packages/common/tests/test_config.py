"""treadle.common.config on a small tree: switches, YAML defaults + overrides, dumps, retired flags,
validation messages that name the full flag."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Literal

import pytest

from treadle.common.config import (
    ConfigError,
    alias,
    configclass,
    deferred_validation,
    dump_yaml,
    flag_names,
    from_dict,
    load_yaml,
    parse,
    secret,
    switch_only,
    to_dict,
    validate,
    value_alias,
)


@configclass
class Inner:
    """A nested group."""

    size: int = 4
    """Must be >= 1."""
    band: tuple[float, float] = (0.5, 5.0)
    """A (low, high) pair."""
    mode: Literal["fast", "slow"] = "fast"
    """A choice."""
    token: str | None = secret()
    """A secret."""

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ConfigError(f"--size must be >= 1, got {self.size}")
        if not self.band[0] < self.band[1]:
            raise ConfigError(f"--band must be low < high, got {list(self.band)}")


@configclass
class Data:
    """A group used once, with an aliased field."""

    max_len: Annotated[int, alias("--max_length")] = 16
    """A field with an extra (un-dotted) spelling."""
    style: Annotated[Literal["plain", "chat"], value_alias("--chat_enable", "chat")] = "plain"
    """A choice one value of which also has a switch of its own."""


@configclass
class Top:
    """A small command."""

    data: Data = Data()
    """The data group."""
    inner: Inner = Inner()
    """The group."""
    other: Inner = Inner(size=8)
    """The same group type elsewhere, with another default."""
    enable: bool = False
    """A bare switch."""
    lr: float = 1e-3
    """A float."""
    tags: tuple[str, ...] = ("a",)
    """Any number of strings."""
    limit: int | None = None
    """Optional."""
    no_cache: Annotated[bool, switch_only()] = False
    """A switch whose name already negates: no --no_no_cache twin."""
    overlap: bool | None = None
    """Tri-state: None leaves the choice to the library."""

    def __post_init__(self) -> None:
        if self.enable and self.inner.size > self.other.size:
            raise ConfigError(f"--enable needs --inner.size <= --other.size, got {self.inner.size} > {self.other.size}")


RENAMED = {"--old_size": "--inner.size"}


def test_bare_switch_and_typed_values():
    cfg = parse(Top, ["--enable", "--inner.size", "3", "--inner.band", "0.1", "2", "--tags", "x", "y",
                      "--limit", "None", "--lr", "5e-6"])
    assert cfg.enable is True
    assert cfg.inner.size == 3 and cfg.inner.band == (0.1, 2.0)
    assert cfg.tags == ("x", "y") and cfg.limit is None and cfg.lr == 5e-6
    assert cfg.other.size == 8  # nested default instance kept
    assert parse(Top, ["--enable", "--no_enable"]).enable is False
    assert parse(Top, ["--no_cache"]).no_cache is True


def test_tri_state_flag_takes_a_value_or_stands_alone_as_true():
    """OpenRLHF's store-true habit: ``--overlap`` alone (last, or before another flag) is True."""
    assert parse(Top, ["--overlap"]).overlap is True
    assert parse(Top, ["--overlap", "--lr", "0.5"]).overlap is True
    assert parse(Top, ["--overlap", "False"]).overlap is False and parse(Top, ["--overlap", "None"]).overlap is None
    assert parse(Top, []).overlap is None
    with pytest.raises(SystemExit):  # a flag that takes a value other than a boolean still needs it
        parse(Top, ["--lr"])


def test_alias_spelling_parses_to_the_field():
    assert parse(Top, ["--max_length", "7"]).data.max_len == 7
    assert parse(Top, ["--data.max_len", "9"]).data.max_len == 9


def test_value_alias_switch_sets_its_value():
    assert parse(Top, []).data.style == "plain"
    assert parse(Top, ["--chat_enable"]) == parse(Top, ["--data.style", "chat"])
    assert parse(Top, ["--chat-enable", "--lr", "0.5"]).data.style == "chat"
    assert parse(Top, ["--chat_enable", "--data.style", "plain"]).data.style == "plain"  # the last one wins
    with pytest.raises(ConfigError, match=r"--chat_enable is a switch \(it means --data\.style chat\)"):
        parse(Top, ["--chat_enable=1"])
    assert "--chat_enable" in flag_names(Top)


def test_a_value_alias_at_two_places_of_a_tree_is_refused():
    @configclass
    class Twice:
        a: Data = Data()
        b: Data = Data()

    with pytest.raises(TypeError, match="--chat_enable is declared on both --a.style and --b.style"):
        parse(Twice, [])


def test_help_shows_alias_and_config(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")  # the help box wraps at the terminal width
    with pytest.raises(SystemExit) as exc:
        parse(Top, ["--help"], prog="top")
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--max_length INT, --data.max_len INT" in out
    assert "--config FILE.yaml" in out


def test_flag_names_lists_switch_pairs_aliases_and_config():
    flags = flag_names(Top)
    for f in ("--enable", "--no_enable", "--inner.size", "--other.band", "--max_length", "--data.max_len",
              "--config", "--help"):
        assert f in flags, f
    assert "--no_cache" in flags and "--no_no_cache" not in flags
    assert flags == sorted(flags)
    assert not any("-" in f.lstrip("-") for f in flags)  # underscores kept, never hyphenated


def test_invalid_value_names_full_flag_and_value():
    with pytest.raises(ConfigError, match=r"--other\.size must be >= 1, got 0"):
        parse(Top, ["--other.size", "0"])
    with pytest.raises(ConfigError, match=r"--inner\.band must be low < high, got \[5\.0, 1\.0\]"):
        parse(Top, ["--inner.band", "5", "1"])


def test_combination_error_names_both_flags():
    with pytest.raises(ConfigError, match=r"--enable needs --inner\.size <= --other\.size, got 9 > 8"):
        parse(Top, ["--enable", "--inner.size", "9"])


def test_direct_construction_validates_with_relative_flags():
    with pytest.raises(ConfigError, match=r"^--size must be >= 1, got 0$"):
        Inner(size=0)


def test_wrong_type_exits_with_tyro_message_naming_the_flag(capsys):
    with pytest.raises(SystemExit) as exc:
        parse(Top, ["--inner.size", "abc"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--inner.size" in err and "abc" in err


def test_unknown_choice_is_rejected(capsys):
    with pytest.raises(SystemExit):
        parse(Top, ["--inner.mode", "medium"])
    assert "medium" in capsys.readouterr().err


def test_renamed_flag_is_an_error_naming_the_new_one():
    with pytest.raises(ConfigError, match=r"--old_size was renamed: use --inner\.size"):
        parse(Top, ["--old_size", "3"], renamed=RENAMED)
    with pytest.raises(ConfigError, match="--inner.size"):
        parse(Top, ["--old_size=3"], renamed=RENAMED)
    with pytest.raises(ConfigError, match=r"--old-size was renamed: use --inner\.size"):
        parse(Top, ["--old-size", "3"], renamed=RENAMED)
    assert parse(Top, ["--inner.size", "3"], renamed=RENAMED).inner.size == 3


def test_yaml_defaults_then_cli_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("enable: true\nlr: 1e-5\ninner:\n  size: 2\n  band: [1, 3]\nother.size: 12\n")
    cfg = parse(Top, ["--config", str(path), "--inner.size", "5"])
    assert cfg.enable is True and cfg.lr == 1e-5  # from YAML (PyYAML reads 1e-5 as a string)
    assert cfg.inner.band == (1.0, 3.0) and cfg.other.size == 12  # nested and dotted keys
    assert cfg.inner.size == 5  # the command line wins
    assert cfg.other.band == (0.5, 5.0)  # untouched keys keep their defaults


def test_yaml_value_completed_by_cli_is_validated_only_at_the_end(tmp_path):
    # enable + inner.size 9 alone is invalid; the command line raises other.size to fix it.
    path = tmp_path / "run.yaml"
    path.write_text("enable: true\ninner: {size: 9}\n")
    cfg = parse(Top, [f"--config={path}", "--other.size", "10"])
    assert (cfg.inner.size, cfg.other.size) == (9, 10)
    with pytest.raises(ConfigError, match=r"--inner\.size <= --other\.size"):
        parse(Top, ["--config", str(path)])


@pytest.mark.parametrize(("text", "pattern"), [
    ("inner: {sise: 3}\n", r"unknown config key 'inner\.sise'; did you mean 'size'\?"),
    ("inner: {size: three}\n", r"inner\.size='three': expected an integer"),
    ("inner: {mode: medium}\n", r"inner\.mode='medium': expected one of \['fast', 'slow'\]"),
    ("inner: {band: [1]}\n", r"inner\.band=\[1\]: expected 2 values"),
    ("enable: 1\n", r"enable=1: expected true or false"),
])
def test_bad_yaml_names_the_key(tmp_path, text, pattern):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=pattern):
        parse(Top, ["--config", str(path)])


def test_missing_config_file_and_repeated_config():
    with pytest.raises(ConfigError, match="cannot read"):
        parse(Top, ["--config", "/nonexistent/x.yaml"])
    with pytest.raises(ConfigError, match="given 2 times"):
        parse(Top, ["--config", "a.yaml", "--config", "b.yaml"])


def test_dump_and_load_round_trip(tmp_path):
    cfg = parse(Top, ["--enable", "--inner.band", "0.25", "4", "--tags", "p", "q", "--limit", "3",
                      "--lr", "inf"])
    text = dump_yaml(cfg, tmp_path / "resolved.yaml")
    assert (tmp_path / "resolved.yaml").read_text() == text
    again = load_yaml(Top, tmp_path / "resolved.yaml")
    assert again == cfg and isinstance(again.tags, tuple)
    assert load_yaml(Top, text) == cfg  # YAML text works too
    assert parse(Top, ["--config", str(tmp_path / "resolved.yaml")]) == cfg


def test_secrets_are_nulled_in_dumps_unless_asked():
    cfg = parse(Top, ["--inner.token", "sk-123"])
    assert "sk-123" not in dump_yaml(cfg)
    assert load_yaml(Top, dump_yaml(cfg)).inner.token is None
    assert load_yaml(Top, dump_yaml(cfg, redact=False)) == cfg


def test_from_dict_and_validate_helpers():
    with deferred_validation():
        loose = Inner(size=0)  # constructing is allowed while deferred ...
    with pytest.raises(ConfigError, match="--size"):
        validate(loose)  # ... and validation catches it afterwards
    cfg = from_dict(Top, {"inner": {"size": 2}})
    assert cfg.inner.size == 2 and to_dict(cfg)["inner"]["band"] == [0.5, 5.0]


def test_configclass_is_frozen_slotted_keyword_only():
    cfg = Top()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.lr = 1.0  # type: ignore[misc]
    assert not hasattr(cfg, "__dict__")
    with pytest.raises(TypeError):
        Inner(3)  # type: ignore[misc]
