"""Command-line options generated from config fields, so a flag's name, help and default are
the field's (``common/config.py``): one place says what a setting means and what it defaults to.

    grpc_port: int = field_option(ServeConfig, "grpc_port")            # default: the field's
    grpc_port: int | None = field_option(ServeConfig, "grpc_port", override=True)
        # default None (the flag overrides serve.toml only when given); help shows the field's

Importing this module imports pydantic and typer, never torch (``recserve --help`` stays fast).
"""

from __future__ import annotations

from typing import Any

import typer
from pydantic import BaseModel
from pydantic_core import PydanticUndefined
from rich.markup import escape


def field_help(cls: type[BaseModel], name: str) -> str:
    """The field's description (its docstring) on one line, without reST markup."""
    text = cls.model_fields[name].description or ""
    return escape(" ".join(text.replace("``", "").split()))  # typer's rich help: [x] is markup


def field_default(cls: type[BaseModel], name: str) -> Any:
    """The field's default (``...``: required)."""
    field = cls.model_fields[name]
    if field.default is PydanticUndefined:
        return ... if field.default_factory is None else field.default_factory()  # type: ignore[call-arg]
    return field.default


def field_flag(cls: type[BaseModel], name: str) -> str:
    """The flag that sets the field (the config's ``flags``; ``--a/--no-a`` for a switch)."""
    flags: dict[str, str] = getattr(cls, "flags", {})
    return flags[name]


def field_option(cls: type[BaseModel], name: str, override: bool = False) -> Any:
    """A ``typer.Option`` for field ``name`` of ``cls``: its flag, help and default. With
    ``override`` the option defaults to None (given only when typed) and its help shows the
    field's default, which applies when neither the flag nor the config file sets it."""
    default = field_default(cls, name)
    shown: bool | str = True
    if override:
        shown = "off" if default is None else str(default) if default is not ... else False
        default = None
    elif default is None:
        shown = False
    return typer.Option(
        default, *field_flag(cls, name).split(" "), help=field_help(cls, name), show_default=shown
    )
