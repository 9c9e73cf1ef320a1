"""Where each value of a run's configuration comes from: the command line split into its config files and its
dotted flags, and each config file read with the line of every key.

Precedence is defaults < config files in the order given < command line flags, wherever the flags stand: the
files are moved in front of the flags before jsonargparse (which applies arguments left to right) reads them, so a
`--config` given after `--trainer.max_epochs 5` cannot silently undo it (Lightning #17533).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import yaml

CONFIG_FLAGS = ("--config", "-c")
PRECEDENCE = "defaults < config files in the order given < command line flags (wherever they stand)"


@dataclass
class ConfigFile:
    """One config file: its parsed contents and the line (1-based) of every dotted key in it."""

    path: str
    data: Any
    lines: dict[str, int] = field(default_factory=dict)
    found: bool = True
    is_file: bool = True
    changed: bool = False  # the checks took Lightning's defaults out: jsonargparse gets the contents, not the file

    def where(self, key: str) -> str:
        line = self.lines.get(key)
        return f"{self.path}, line {line}" if line else self.path


@dataclass
class Flag:
    """One `--dotted.key value` flag of the command line (the value None when it is in the next token or absent)."""

    key: str
    text: str
    value: str | None = None

    def where(self) -> str:
        return f"the command line flag {self.text}"


@dataclass
class Sources:
    """The command line of one subcommand, split: config files (in order), flags, and the other tokens."""

    subcommand: str | None
    files: list[ConfigFile]
    flags: list[Flag]
    prefix: list[str]  # up to and including the subcommand
    rest: list[str]  # every token but the config files, as given

    def argv(self) -> list[str]:
        """For jsonargparse: the subcommand, then every config file (its contents, as checked and adapted), then
        the flags as given."""
        configs = []
        for file in self.files:
            if not file.found or (file.is_file and not file.changed):
                configs += ["--config", file.path]  # as given: its relative paths, or jsonargparse names it missing
            elif file.data:
                configs += ["--config", yaml.safe_dump(file.data, sort_keys=False)]
        return self.prefix + configs + self.rest

    def add_first(self, path: str) -> None:
        """Put a config file before all the others (the saved config of the run being resumed)."""
        self.files.insert(0, read_config(path))

    def where(self, key: str) -> str:
        """The last source that sets `key` (or a key inside it): a flag, else the last file, else the defaults."""
        for flag in reversed(self.flags):
            if flag.key == key or flag.key.startswith(key + ".") or key.startswith(flag.key + "."):
                return flag.where()
        for file in reversed(self.files):
            if key in file.lines:
                return file.where(key)
        return "the defaults"


def split_command_line(argv: list[str], subcommands: list[str] | None) -> Sources:
    """Split `argv` into the subcommand, its config files and its flags, with the files moved in front."""
    argv = list(argv)
    subcommand, prefix = None, []
    if subcommands is not None:
        index = next((i for i, token in enumerate(argv) if not token.startswith("-")), None)
        if index is not None and argv[index] in subcommands:
            subcommand, prefix, argv = argv[index], argv[: index + 1], argv[index + 1 :]
    files, rest, flags = [], [], []
    i = 0
    while i < len(argv):
        token = argv[i]
        name, eq, value = token.partition("=")
        if name in CONFIG_FLAGS:
            if not eq:
                i += 1
                value = argv[i] if i < len(argv) else ""
            files.append(read_config(value))
        else:
            rest.append(token)
            if token.startswith("--") and len(token) > 2:
                key = name[2:].rstrip("+")
                following = argv[i + 1] if i + 1 < len(argv) and not eq else None
                flags.append(Flag(key, name, value if eq else following))
        i += 1
    return Sources(subcommand, files, flags, prefix, rest)


def read_config(text: str) -> ConfigFile:
    """A config file (or a YAML string given in its place, as jsonargparse allows) with the line of each key."""
    if os.path.isfile(text):
        with open(text) as f:
            source, label = f.read(), text
    elif ":" in text:
        source, label = text, "the YAML given to --config"
    else:
        return ConfigFile(text, None, found=False)
    node = yaml.compose(source, Loader=yaml.SafeLoader)
    lines: dict[str, int] = {}
    _record_lines(node, "", lines)
    return ConfigFile(label, yaml.safe_load(source), lines, is_file=label == text)


def _record_lines(node: Any, prefix: str, lines: dict[str, int]) -> None:
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            key = f"{prefix}{key_node.value}"
            lines[key] = key_node.start_mark.line + 1
            _record_lines(value_node, key + ".", lines)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _record_lines(item, f"{prefix}{index}.", lines)
