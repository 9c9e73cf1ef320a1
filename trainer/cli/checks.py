"""Checking a run's configuration before it is used: every key of every config file and every flag must be one the
parser knows, else a `ConfigError` names the key, where it came from (file and line, or the flag) and the closest
valid keys, including the same name in another section. jsonargparse checks the types; its errors are given back
with the same source and the expected type.

Lightning's files are read as Lightning reads them: `null` for a Trainer argument means its default, and a
Lightning-only argument at its Lightning default (as `--print_config` writes every one) changes nothing.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import re
import typing
from typing import Any

from ..unsupported import CLOSEST
from .sources import ConfigFile, Sources

SUBCLASS_KEYS = ("class_path", "init_args", "dict_kwargs", "__path__")
# Lightning's Trainer (2.x) arguments this Trainer does not take, at Lightning's defaults
LIGHTNING_ONLY_TRAINER = {
    "min_epochs": None,
    "min_steps": None,
    "limit_predict_batches": None,
    "overfit_batches": 0.0,
    "benchmark": None,
    "inference_mode": True,
    "detect_anomaly": False,
    "barebones": False,
    "plugins": None,
    "reload_dataloaders_every_n_epochs": 0,
    "enable_autolog_hparams": True,
    "model_registry": None,
}
LIGHTNING_ONLY_METHOD = {"verbose": True, "return_predictions": None, "weights_only": None}  # of its methods


class ConfigError(ValueError):
    """A configuration the command line refuses: an unknown key, a value of the wrong type, a missing file."""


class KeyIndex:
    """The keys one (sub)command's parser accepts: leaves (arguments) and the groups above them."""

    def __init__(self, parser: Any) -> None:
        skip = ("help", "config", "print_config")
        actions = [a for a in parser._actions if a.dest not in skip]
        # a group's own `--trainer CONFIG` action (sub_configs) is the group, not an argument
        self.actions = {a.dest: a for a in actions if type(a).__name__ != "_ActionConfigLoad"}
        self.groups = {".".join(k.split(".")[:i]) for k in self.actions for i in range(1, k.count(".") + 1)}
        self.groups |= {a.dest for a in actions if type(a).__name__ == "_ActionConfigLoad"}

    def all_keys(self) -> list[str]:
        return sorted(set(self.actions) | self.groups)

    def unknown(self, key: str, where: str) -> ConfigError:
        name = key.rsplit(".", 1)[-1]
        elsewhere = [k for k in self.all_keys() if k.rsplit(".", 1)[-1] == name and k != key]
        close = [k for k in difflib.get_close_matches(key, self.all_keys(), n=3, cutoff=0.6) if k not in elsewhere]
        message = f"unknown key {key!r} ({where})"
        if elsewhere:
            message += f"; {name!r} is a key of another section: {', '.join(elsewhere)}"
        if close:
            message += f"; the closest valid keys: {', '.join(close)}"
        if not elsewhere and not close:
            parent = key.rsplit(".", 1)[0] if "." in key else ""
            siblings = [k for k in self.all_keys() if k.rsplit(".", 1)[0] == parent and "." in k] if parent else []
            message += f"; the valid keys here: {', '.join(siblings or [k for k in self.all_keys() if '.' not in k])}"
        return ConfigError(message)

    def subclass_leaf(self, key: str) -> str | None:
        """The longest prefix of `key` that is an argument taking a class (`class_path`/`init_args`)."""
        parts = key.split(".")
        for i in range(len(parts) - 1, 0, -1):
            prefix = ".".join(parts[:i])
            if prefix in self.actions:
                return prefix
        return None


def check_sources(index: KeyIndex, sources: Sources) -> None:
    """Every key of every config file and every flag is known (files first, in order, then the flags)."""
    for file in sources.files:
        if file.found and file.data is not None:
            if not isinstance(file.data, dict):
                raise ConfigError(f"{file.path}: a config file must be a mapping of keys (trainer:, model:, ...)")
            checked = _check_mapping(index, file, file.data, "")
            file.changed, file.data = checked != file.data, checked
    for flag in sources.flags:
        _check_flag(index, sources, flag)


def _check_mapping(index: KeyIndex, file: ConfigFile, mapping: dict, prefix: str) -> dict:
    """The checked mapping, with what Lightning means by its defaults taken out."""
    kept = {}
    for name, value in mapping.items():
        key = f"{prefix}{name}"
        if _lightning_default(key, value):
            continue
        if key in index.actions:
            _check_class_value(index, file, key, value)
            kept[name] = value
        elif key in index.groups and isinstance(value, dict):
            kept[name] = _check_mapping(index, file, value, key + ".")
        elif key in index.groups and value is None:
            continue  # an empty section
        elif key in index.groups:
            kept[name] = value  # a section given as a file of its own (`model: model.yaml`): jsonargparse reads it
        elif str(name).startswith("__"):
            kept[name] = value
        else:
            raise _unsupported(key, value, file.where(key)) or index.unknown(key, file.where(key))
    return kept


def _lightning_default(key: str, value: Any) -> bool:
    """A Trainer argument set to null (Lightning: the default), or a Lightning-only one at its default."""
    section, _, name = key.partition(".")
    if section == "trainer" and "." not in name:
        return value is None or (name in LIGHTNING_ONLY_TRAINER and value == LIGHTNING_ONLY_TRAINER[name])
    return "." not in key and key in LIGHTNING_ONLY_METHOD and value == LIGHTNING_ONLY_METHOD[key]


def _unsupported(key: str, value: Any, where: str) -> ConfigError | None:
    section, _, name = key.partition(".")
    if section == "trainer" and name in CLOSEST:
        return ConfigError(
            f"{key}: {value!r} ({where}) is a Lightning Trainer argument this Trainer does not "
            f"support; the closest thing here: {CLOSEST[name]}"
        )
    return None


def _check_class_value(index: KeyIndex, file: ConfigFile, key: str, value: Any) -> None:
    """`class_path`/`init_args` values (a logger, callbacks, a subclass-mode model): init_args the class takes."""
    items = value if isinstance(value, list) else [value]
    for position, item in enumerate(items):
        if not isinstance(item, dict) or "class_path" not in item:
            continue
        at = f"{key}.{position}" if isinstance(value, list) else key
        cls = resolve_class(item["class_path"], index.actions[key])
        accepted = init_arguments(cls)
        if accepted is None:
            continue
        given = dict(item.get("init_args") or {})
        given.update({k: v for k, v in item.items() if k not in SUBCLASS_KEYS})
        for name in given:
            if name not in accepted:
                where_key = f"{at}.init_args.{name}" if name in (item.get("init_args") or {}) else f"{at}.{name}"
                raise _unknown_argument(cls, f"{key}.init_args.{name}", name, accepted, file.where(where_key))


def _check_flag(index: KeyIndex, sources: Sources, flag: Any) -> None:
    key = flag.key
    if key in index.actions or key in index.groups or key in ("help", "print_config"):
        return
    leaf = index.subclass_leaf(key)
    if leaf is None:
        raise _unsupported(key, flag.value, flag.where()) or index.unknown(key, flag.where())
    rest = key[len(leaf) + 1 :].split(".")
    rest = rest[1:] if rest[0] == "init_args" else rest
    if not rest or rest[0] in SUBCLASS_KEYS:
        return
    cls = resolve_class(_class_path_given(sources, leaf), index.actions[leaf])
    accepted = init_arguments(cls)
    if accepted is not None and rest[0] not in accepted:
        raise _unknown_argument(cls, f"{leaf}.init_args.{rest[0]}", rest[0], accepted, flag.where())


def _class_path_given(sources: Sources, leaf: str) -> str | None:
    """The class chosen for `leaf`: by the last flag that names it, else the last config file."""
    for flag in reversed(sources.flags):
        if flag.key in (leaf, f"{leaf}.class_path") and flag.value and not flag.value.startswith("{"):
            return flag.value
    for file in reversed(sources.files):
        node = file.data
        for part in leaf.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and node.get("class_path"):
            return node["class_path"]
    return None


def _unknown_argument(cls: type, key: str, name: str, accepted: list[str], where: str) -> ConfigError:
    close = difflib.get_close_matches(name, accepted, n=3, cutoff=0.6)
    hint = f"the closest valid keys: {', '.join(close)}" if close else f"its arguments: {', '.join(accepted)}"
    return ConfigError(f"unknown key {key!r} ({where}): {cls.__name__} takes no argument {name!r}; {hint}")


def resolve_class(class_path: Any, action: Any) -> type | None:
    """The class a `class_path` names: a dotted import path, or a class name among the subclasses of the
    argument's type (as jsonargparse accepts it); None when it cannot be found (jsonargparse then says so)."""
    if not isinstance(class_path, str):
        return None
    if "." in class_path:
        module, _, name = class_path.rpartition(".")
        try:
            return getattr(importlib.import_module(module), name, None)
        except ImportError:
            return None
    for base in _classes_in(getattr(action, "_typehint", None)):
        found = _subclass_named(base, class_path)
        if found is not None:
            return found
    return None


def _classes_in(hint: Any) -> list[type]:
    if inspect.isclass(hint):
        return [hint]
    return [cls for arg in typing.get_args(hint) for cls in _classes_in(arg)]


def _subclass_named(base: type, name: str) -> type | None:
    if base.__name__ == name:
        return base
    for sub in base.__subclasses__():
        found = _subclass_named(sub, name)
        if found is not None:
            return found
    return None


def init_arguments(cls: type | None) -> list[str] | None:
    """The arguments jsonargparse accepts for `cls` (following **kwargs into parents as it does); None when
    unknown."""
    if cls is None:
        return None
    from jsonargparse import ArgumentParser

    try:
        return sorted(ArgumentParser(exit_on_error=False).add_class_arguments(cls, fail_untyped=False))
    except Exception:  # a class jsonargparse cannot describe: it reports the problem itself when parsing
        return None


def explain_parse_error(error: Exception, index: KeyIndex, sources: Sources) -> ConfigError:
    """jsonargparse's error, with where the value came from and the type it must have."""
    message = str(error)
    found = re.search(r'Parser key "([^"]+)"', message)
    if found is None:
        return ConfigError(f"invalid configuration: {message}")
    key = found.group(1)
    action = index.actions.get(key)
    expected = _type_name(getattr(action, "_typehint", None)) if action is not None else None
    given = re.search(r"(?:Given value|Got value): (.*)", message)
    value = f" = {given.group(1).strip()}" if given else ""
    head = f"{key}{value} ({sources.where(key)})"
    detail = "\n  ".join(line.strip() for line in message.splitlines()[1:] if line.strip())
    if expected:
        return ConfigError(f"{head}: expected {expected}\n  {detail}")
    return ConfigError(f"{head}: {detail}")


def _type_name(hint: Any) -> str | None:
    if hint is None:
        return None
    text = hint.__name__ if inspect.isclass(hint) else str(hint)
    return re.sub(r"typing\.Optional\[(.*)\]$", r"\1 | None", re.sub(r"\b(?:[a-z_]\w*\.)+(\w+)", r"\1", text))
