"""Read sections of params.yaml into typed, validated dataclasses.

This module is the generic part only: each section's schema (its dataclass, allowed values and
checks) lives in its own module under quantpipe/schemas/, and a stage imports the schemas it
reads. So an edit to one schema re-runs the stages that read that section and no other
(dvc.yaml lists each stage's schema modules). Strings become ONNX Runtime enums here, once;
library code only sees enums. Every error names the key, the bad value and what is allowed, so
a user can fix params.yaml from one line.
"""

from __future__ import annotations

import dataclasses
import pkgutil
import types
import typing
from pathlib import Path
from typing import TypeVar

import yaml

from quantpipe import schemas
from quantpipe.errors import UserError

PARAMS_FILE = Path("params.yaml")
T = TypeVar("T")


def sections() -> list[str]:
    """Every top-level key params.yaml may hold: one per schema module, and `seed`."""
    return ["seed", *(m.name for m in pkgutil.iter_modules(schemas.__path__) if m.name != "all")]


def read(path: Path = PARAMS_FILE) -> dict:
    """params.yaml as a mapping; a missing file, bad YAML or an unknown section is one line."""
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise UserError(f"{path}: not found; run from the project root") from None
    except yaml.YAMLError as e:
        raise UserError(f"{path}: not valid YAML: {str(e).splitlines()[0]}") from None
    raw = raw or {}
    if not isinstance(raw, dict):
        raise UserError(f"{path}: top level: expected a mapping, got {raw!r}")
    known = sections()
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise UserError(f"{path}: unknown key {unknown[0]}; allowed keys: {', '.join(known)}")
    return raw


def section(cls: type[T], raw: dict, source: str = "params") -> T:
    """The section cls.SECTION of a parsed params mapping (defaults where it is absent)."""
    try:
        return build(cls, raw.get(cls.SECTION, {}), prefix=cls.SECTION + ".")
    except UserError as e:
        raise UserError(f"{source}: {e}") from None


def load(cls: type[T], path: Path = PARAMS_FILE) -> T:
    """One validated section of params.yaml, e.g. load(BenchParams)."""
    return section(cls, read(path), str(path))


def seed(path: Path = PARAMS_FILE) -> int:
    """The top-level `seed` (every random draw of prepare, train and QAT follows it)."""
    return parse_seed(read(path), str(path))


def parse_seed(raw: dict, source: str = "params") -> int:
    value = raw.get("seed", 0)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**32:
        raise UserError(f"{source}: seed = {value!r} is not allowed; use an integer in 0..2**32-1")
    return value


# Keys renamed since they were published: the old name is one line saying the new one.
RENAMED = {"quantize_static.max_accuracy_drop_pp": "quantize_static.max_drop_pts",
           "review.max_accuracy_drop_pp": "review.max_drop_pts"}
# Keys no longer read, and what took their place (`quantpipe upgrade` drops them).
REMOVED = {"quantize_static.calib_memory_mb": "resources.memory_mb now bounds the whole stage "
                                              "(calibration included), and every other stage",
           "bench.max_seconds": "bench.seconds now bounds a variant's whole bench, each "
                                "measurement taking its share"}


def build(cls: type[T], raw: object, prefix: str) -> T:
    if not isinstance(raw, dict):
        raise UserError(f"{prefix.rstrip('.') or 'top level'}: expected a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    for key in unknown:
        if prefix + key in RENAMED:
            raise UserError(f"{prefix}{key} is now {RENAMED[prefix + key]} (the drop of the "
                            "task's score: accuracy, mAP or mIoU, in points); rename it")
        if prefix + key in REMOVED:
            raise UserError(f"{prefix}{key} is no longer read: {REMOVED[prefix + key]}; "
                            "remove it")
    if unknown:
        raise UserError(f"unknown key {prefix}{unknown[0]}; allowed keys: {', '.join(fields)}")
    values = {name: _convert(hints[name], raw[name], prefix + name)
              for name in fields if name in raw}
    return cls(**values)


def _convert(hint, value, key: str):
    if dataclasses.is_dataclass(hint):
        return build(hint, value, prefix=key + ".")
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return _convert(inner[0], value, key)
        for option in inner:  # e.g. int | str, tuple[float, ...] | str: the first that fits
            try:
                return _convert(option, value, key)
            except UserError:
                continue
        names = " or ".join(getattr(a, "__name__", str(a)) for a in inner)
        raise UserError(f"{key} = {value!r}: expected {names}")
    if isinstance(hint, type) and hasattr(hint, "__members__"):  # Python and pybind11 enums
        names = list(hint.__members__)
        if not isinstance(value, str) or value not in names:
            raise UserError(f"{key} = {value!r} is not allowed; use one of {names}")
        return hint.__members__[value]
    if origin is tuple:
        if not isinstance(value, list):
            raise UserError(f"{key} = {value!r}: expected a list")
        return tuple(_convert(args[0], v, f"{key}[{i}]") for i, v in enumerate(value))
    if hint is dict or origin is dict:
        if not isinstance(value, dict):
            raise UserError(f"{key} = {value!r}: expected a mapping")
        return dict(value)
    if hint is bool:
        if not isinstance(value, bool):
            raise UserError(f"{key} = {value!r}: expected true or false")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise UserError(f"{key} = {value!r}: expected an integer")
        return value
    if hint is float:
        if isinstance(value, str):  # YAML 1.1 reads `1e-3` (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UserError(f"{key} = {value!r}: expected a number")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise UserError(f"{key} = {value!r}: expected a string")
        return value
    raise TypeError(f"unsupported params type {hint!r} for {key}")


def check(ok: bool, key: str, value: object, allowed: str) -> None:
    """A schema's validation: raise the one-line error naming key, value and what is allowed."""
    if not ok:
        raise UserError(f"{key} = {value!r} is not allowed; use {allowed}")
