"""One type checker for configs and model arguments: a value against its annotation, converting command-line
text ("3", "true", "a,b", "none") where the value came from text. A leaf module: config and models both use it."""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Any, Literal, Union

from gptoughts.errors import ConfigError, closest, did_you_mean


def _type_name(tp: Any) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _exact(value: Any, tp: Any) -> bool:
    """``value`` already is of type ``tp`` (no conversion: an int is a float, nothing else converts)."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return True
    if origin in (Union, types.UnionType):
        return any(_exact(value, a) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if origin is Literal:
        return value in typing.get_args(tp)
    if origin in (list, tuple):
        args = typing.get_args(tp)
        return isinstance(value, (list, tuple)) and (
            not args or args[-1] is Ellipsis or all(_exact(v, args[0]) for v in value)
        )
    if origin is dict:
        return isinstance(value, dict)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, tp) if isinstance(tp, type) else True


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "None"
    if origin is Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(tp)))
    return getattr(origin or tp, "__name__", str(tp))


def coerce(value: Any, tp: Any, where: str, *, text: bool = True) -> Any:
    """Check ``value`` against annotation ``tp`` (the one type checker of configs and model args).

    ``text``: values may come from the command line, and strings are converted ("3", "true", "a,b", "none");
    otherwise (Python or TOML values given to ``models.model_args``) a value must already have the type."""
    if not text:
        if not _exact(value, tp):
            raise ConfigError(f"{where} must be {_describe(tp)}, got {type(value).__name__} {value!r}")
        return float(value) if tp is float else value
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return _to_union(value, tp, where)
    if origin is Literal:
        return _to_literal(value, tp, where)
    if origin is list:
        return _to_list(value, tp, where)
    if origin is dict or dataclasses.is_dataclass(tp):
        return _to_table(value, tp, where)
    if tp is Any:
        return value
    convert = _SCALARS.get(tp) if isinstance(tp, type) else None
    if convert is not None:
        return convert(value, where)
    raise TypeError(f"unsupported config annotation {tp!r} at {where}")


def _to_union(value: Any, tp: Any, where: str) -> Any:
    args = typing.get_args(tp)
    if value is None and type(None) in args:
        return None
    if isinstance(value, str) and value.lower() in ("none", "null") and type(None) in args:
        return None
    members = [a for a in args if a is not type(None)]
    if len(members) == 1:  # `X | None`: X's own message is the clearer one
        return coerce(value, members[0], where)
    # Try non-str members first so "8" becomes 8 for `int | str`.
    for arg in sorted(members, key=lambda a: a is str):
        try:
            return coerce(value, arg, where)
        except ConfigError:
            pass
    raise ConfigError(f"{where} must be {_type_name(tp)}, got {value!r}")


def _to_literal(value: Any, tp: Any, where: str) -> Any:
    allowed = typing.get_args(tp)
    if value in allowed:
        return value
    near = closest(value, [str(a) for a in allowed]) if isinstance(value, str) else None
    hint = f" (did you mean {near!r}?)" if near else ""
    raise ConfigError(f"{where} must be one of {', '.join(map(str, allowed))}; got {value!r}{hint}")


def _to_list(value: Any, tp: Any, where: str) -> list[Any]:
    (item_tp,) = typing.get_args(tp)
    if isinstance(value, str):
        value = [v for v in value.split(",") if v != ""] if value else []
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{where} must be a list, got {value!r}")
    return [coerce(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value)]


def _to_table(value: Any, tp: Any, where: str) -> Any:
    """A ``dict[...]`` field (copied as is) or a nested dataclass (built field by field)."""
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a table, got {value!r}")
    if typing.get_origin(tp) is dict:
        return dict(value)
    return build_dataclass(tp, value, where)


def _to_bool(value: Any, where: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
        return True
    if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
        return False
    raise ConfigError(f"{where} must be true or false, got {value!r}")


def _to_int(value: Any, where: str) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"{where} must be an integer, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        text = value.strip().replace("_", "")
        try:
            return int(text)
        except ValueError:
            try:  # "1e6" is a fine way to write a token budget
                as_float = float(text)
            except ValueError:
                as_float = None
            if as_float is not None and as_float.is_integer():
                return int(as_float)
    raise ConfigError(f"{where} must be an integer, got {value!r}")


def _to_float(value: Any, where: str) -> float:
    if isinstance(value, bool):
        raise ConfigError(f"{where} must be a number, got {value!r}")
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    raise ConfigError(f"{where} must be a number, got {value!r}")


def _to_str(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    raise ConfigError(f"{where} must be a string, got {value!r}")


_SCALARS: dict[type, Callable[[Any, str], Any]] = {
    bool: _to_bool,
    int: _to_int,
    float: _to_float,
    str: _to_str,
}


def build_dataclass(cls: type, data: dict[str, Any], where: str) -> Any:
    """``cls(**data)`` with every value checked against its field; unknown keys are errors naming the closest
    field, except in a class with a ``catch_all`` field (metadata), which takes them as a dict."""
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    names = [f.name for f in fields]
    catch_all = next((f.name for f in fields if f.metadata.get("catch_all")), None)
    kwargs: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for key, value in data.items():
        if catch_all is not None and (key == catch_all or key not in names):
            extra[key] = value
            continue
        if key not in names:
            raise ConfigError(
                f"unknown config key `{where}.{key}`{did_you_mean(key, names)}".replace("`.", "`")
            )
        kwargs[key] = coerce(value, hints[key], f"{where}.{key}".lstrip("."))
    obj = cls(**kwargs)
    if catch_all is not None:
        getattr(obj, catch_all).update(extra)
    return obj
