"""What every config of ours shares: the pydantic base, the error a bad value raises, the
longest wait.

A config is a :class:`Config`: one pydantic model per concern, every field typed, its
constraints declared once (``Field(ge=1)``, ``Literal``, :data:`WaitS`), a docstring under it
(it becomes the field's description, and the CLI's help). Loading goes through
:meth:`Config.from_dict` / :meth:`Config.from_toml`, which turn pydantic's errors into a
:class:`ConfigError` naming the field as ``section.key`` and the flag that sets it::

    serve.toml: batching.max_batch_size: must be >= 1, got 0
    grpc_port (--grpc-port): must be <= 65535, got 70000
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, Any, ClassVar, Self, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic_core import ErrorDetails

MAX_WAIT_S = 86_400.0
"""Longest wait (delay, timeout, poll period) a config may ask for: one day. More is a unit
mistake, and Python's waits refuse past ~292 years (OverflowError in the thread that waits)."""

WaitS = Annotated[float, Field(ge=0, le=MAX_WAIT_S)]
"""A wait in seconds: finite (every :class:`Config` refuses NaN and infinity), 0 to one day."""
WaitMs = Annotated[float, Field(ge=0, le=MAX_WAIT_S * 1000)]
"""A wait in milliseconds: finite, 0 to one day."""
Port = Annotated[int, Field(ge=0, le=65535)]
"""A TCP port; 0: any free port."""
PathValue = Annotated[Path, Field(strict=False)]
"""A path: TOML and flags give strings (the rest of a config is strict: no ``"1"`` for 1)."""


_NESTED: ContextVar[bool] = ContextVar("config_nested", default=False)
"""True while a config is being built: inner tables leave pydantic's errors to the outermost."""


class ConfigError(ValueError):
    """A bad config value; the message names the field (``section.key``) and, where there is one,
    the flag that sets it."""


class Config(BaseModel):
    """Base of our configs: unknown keys refused, types strict (a TOML string is no number, a
    bool no int), numbers finite, field docstrings as descriptions."""

    model_config = ConfigDict(
        extra="forbid", strict=True, allow_inf_nan=False, use_attribute_docstrings=True
    )
    flags: ClassVar[Mapping[str, str]] = {}
    """Field -> the command-line flag that sets it, named in errors beside the key (and the
    flag the CLI declares for it)."""

    def __init__(self, /, **data: Any) -> None:
        """Builds and checks the fields (:class:`ConfigError` naming the first bad one)."""
        if _NESTED.get():  # a table inside a config being built: the outer one names the error
            super().__init__(**data)
            return
        nested = _NESTED.set(True)
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise ConfigError(describe(type(self), e.errors(include_url=False)[0])) from None
        finally:
            _NESTED.reset(nested)

    def validate(self) -> None:  # type: ignore[override]  # pydantic's is a deprecated v1 name
        """What the fields cannot say alone (cross-field rules, files that must exist), checked
        at start-up; :class:`ConfigError` naming the field. The base has none."""

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "", prefix: str = "") -> Self:
        """Builds from TOML-like data; :class:`ConfigError` ``"<where>: <prefix><field>: why"``
        on the first bad value."""
        nested = _NESTED.set(True)  # pydantic calls our __init__: let its errors through
        try:
            return cls.model_validate(dict(data))
        except ValidationError as e:
            message = describe(cls, e.errors(include_url=False)[0], prefix)
            raise ConfigError(f"{where}: {message}" if where else message) from None
        finally:
            _NESTED.reset(nested)

    @classmethod
    def from_toml(cls, path: Path, prefix: str = "") -> Self:
        """Reads ``path`` (UTF-8 TOML) and builds; errors start with ``--config`` or the path."""
        return cls.from_dict(read_toml(path), where=str(path), prefix=prefix)

    def updated(self, **values: Any) -> Self:
        """A copy with ``values`` applied (None: left as it is), validated like a file's values;
        errors name the field and its flag."""
        given = {k: v for k, v in values.items() if v is not None}
        return type(self).from_dict({**dict(self), **given})


def read_toml(path: Path) -> dict[str, Any]:
    """``path`` parsed; :class:`ConfigError` starting ``--config:`` when it cannot be."""
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))  # TOML is UTF-8
    except OSError as e:
        raise ConfigError(f"--config: cannot read {path}: {e}") from None
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"--config: {path} is not valid TOML: {e}") from None
    except RecursionError:  # tomllib recurses once per level of nested arrays and tables
        raise ConfigError(f"--config: {path} is not valid TOML: nested too deep") from None


# ---- pydantic's errors in our words -------------------------------------------------------------
def describe(cls: type[BaseModel], error: ErrorDetails, prefix: str = "") -> str:
    """One pydantic error -> ``"section.key (--flag): why"``."""
    loc = error["loc"]
    name = prefix + "".join(_part(p, first=i == 0) for i, p in enumerate(loc))
    flag = _flag(cls, loc)
    return f"{name}{f' ({flag})' if flag else ''}: {_why(cls, error)}"


def _part(p: int | str, first: bool) -> str:
    """One step of an error's location: ``[3]`` (a list item), ``.key``, or ``['a key']`` for a
    key that is no identifier (a file may hold any TOML key: the message must still parse)."""
    if isinstance(p, int):
        return f"[{p}]"
    if not p.isidentifier():
        return f"[{p!r}]"
    return p if first else f".{p}"


def _why(cls: type[BaseModel], error: ErrorDetails) -> str:
    kind, ctx, value = error["type"], error.get("ctx", {}), error.get("input")
    shown = f"{value!r:.60}"
    if kind == "extra_forbidden":
        owner = _owner(cls, error["loc"])
        known = sorted(owner.model_fields) if owner is not None else []
        return f"unknown key (known: {known})"
    if kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
        return f"must be {_range(cls, error)}, got {shown}"
    if kind == "finite_number":
        return f"must be a finite number, got {shown}"
    if kind == "literal_error":
        return f"expected {ctx['expected']}, got {shown}"
    if kind in ("too_short", "string_too_short"):
        return f"must hold at least {ctx['min_length']} item(s), got {shown}"
    if kind == "string_pattern_mismatch":
        return f"must match {ctx['pattern']!r}, got {shown}"
    if kind == "missing":
        return "required"
    if kind == "value_error":
        return str(ctx.get("error", error["msg"]))
    if kind.endswith("_type") or kind in ("is_instance_of", "model_type", "dataclass_type"):
        expected = kind.removesuffix("_type").replace("model", "table").replace("dict", "table")
        return f"expected {expected}, got {shown}"
    return f"{error['msg'][0].lower()}{error['msg'][1:]}, got {shown}"


def _range(cls: type[BaseModel], error: ErrorDetails) -> str:
    """``in [lo, hi]`` for a field bounded both ways (inclusive), else ``>= lo`` and the like."""
    owner, loc = _owner(cls, error["loc"]), error["loc"]
    field = owner.model_fields.get(str(loc[-1])) if owner is not None else None
    bounds = {
        k: getattr(m, k) for m in (field.metadata if field else ()) for k in BOUNDS if hasattr(m, k)
    }
    if set(bounds) == {"ge", "le"}:
        lo, hi = bounds["ge"], bounds["le"]
    else:
        kind, bound = error["type"], next(iter(error.get("ctx", {}).values()))
        lo, hi = (bound, None) if kind.startswith("greater") else (None, bound)
        if lo is not None:
            return f"{'>=' if kind == 'greater_than_equal' else '>'} {lo}"
        op = "<=" if kind == "less_than_equal" else "<"
        return f"{op} {hi}{' (one day)' if hi in (MAX_WAIT_S, MAX_WAIT_S * 1000) else ''}"
    day = " (one day)" if hi in (MAX_WAIT_S, MAX_WAIT_S * 1000) else ""
    return f"in [{lo}, {hi}]{day}"


BOUNDS = ("ge", "gt", "le", "lt")


def _owner(cls: type[BaseModel], loc: tuple[int | str, ...]) -> type[BaseModel] | None:
    """The model class that holds the field named by the last string of ``loc``."""
    owner: type[BaseModel] | None = cls
    keys = [p for p in loc if isinstance(p, str)]
    for key in keys[:-1]:
        field = owner.model_fields.get(key) if owner is not None else None
        if field is None:
            return None
        owner = next(
            (t for t in (field.annotation, *get_args(field.annotation)) if _is_model(t)), None
        )
    return owner


def _flag(cls: type[BaseModel], loc: tuple[int | str, ...]) -> str | None:
    owner = _owner(cls, loc)
    keys = [p for p in loc if isinstance(p, str)]
    flags = getattr(owner, "flags", {})
    return flags.get(keys[-1]) if keys and isinstance(flags, Mapping) else None


def _is_model(t: Any) -> bool:
    return isinstance(t, type) and issubclass(t, BaseModel)
