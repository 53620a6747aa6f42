"""The value types every config struct is built from, the one validation entry point, and the
surfaces derived from a struct: command-line flags and flat keys (the vLLM connector's).

A leaf module (msgspec and errors only), so that each tier module can own its config struct
without importing the config of the components above it.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Annotated, Any, Callable, Literal, Mapping

import msgspec

from kvtier.errors import ConfigError

GB = 1 << 30

Fraction = Annotated[float, msgspec.Meta(gt=0, le=1)]
NonNegativeFraction = Annotated[float, msgspec.Meta(ge=0, le=1)]
PositiveGB = Annotated[float, msgspec.Meta(gt=0)]
PositiveSeconds = Annotated[float, msgspec.Meta(gt=0)]
EvictionPolicyName = Literal["LRU", "FIFO", "LFU", "COST"]
AdmissionName = Literal["none", "tinylfu"]
WindowShare = Annotated[float, msgspec.Meta(gt=0, lt=1)]
#: Whose objects a store writes (tiers/tenants.py); empty: the default tenant.
TenantName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.:@-]{0,64}$")]


def convert(data: object, schema: type) -> object:
    """Validate plain data (from JSON or a dict) into ``schema``, or raise ConfigError."""
    try:
        return msgspec.convert(data, schema)
    except msgspec.ValidationError as exc:
        raise ConfigError(str(exc)) from None


# -- one schema, many surfaces: flags, environment variables, flat keys ------------------------------
#
# A config struct is a tree; its leaves are options. A leaf's flat key joins the field names on its
# path with "_" ("l1" then "size_gb": "l1_size_gb"); a struct field marked
# ``Meta(extra={"prefix": ""})`` adds nothing (``ServerConfig.store``: "--chunk-size", not
# "--store-chunk-size"). A leaf's flag is its key with dashes, unless ``extra["flag"]`` names it;
# ``extra["aliases"]`` are older flag names that keep working; ``extra["env"]`` names an environment
# variable read when the flag is not given. Help text is the field's ``Meta(description=...)``;
# defaults and bounds come from the struct alone, so no surface restates them.


@dataclass(frozen=True)
class Option:
    path: tuple[str, ...]  # field names from the root struct to the leaf
    key: str  # the flat key
    type: msgspec.inspect.Type  # without Metadata layers and without None
    required: bool
    default: Any
    description: str
    extra: dict

    @property
    def flag(self) -> str:
        return self.extra.get("flag", "--" + self.key.replace("_", "-"))

    @property
    def json_path(self) -> str:
        """How msgspec names this option in a validation error."""
        return "$." + ".".join(self.path)


def _unwrap(t: msgspec.inspect.Type) -> tuple[msgspec.inspect.Type, str, dict]:
    """The type under its Metadata layers and without None, its description and extra."""
    description, extra = "", {}
    while True:
        if isinstance(t, msgspec.inspect.Metadata):
            description = (t.extra_json_schema or {}).get("description", description)
            extra = {**(t.extra or {}), **extra}
            t = t.type
        elif isinstance(t, msgspec.inspect.UnionType) and any(isinstance(u, msgspec.inspect.NoneType) for u in t.types):
            rest = [u for u in t.types if not isinstance(u, msgspec.inspect.NoneType)]
            if len(rest) != 1:
                return t, description, extra
            t = rest[0]
        else:
            return t, description, extra


def _default(field: msgspec.inspect.Field) -> Any:
    if field.default_factory is not msgspec.NODEFAULT:
        return field.default_factory()
    return field.default


def options(schema: type, _path: tuple[str, ...] = (), _key: str = "") -> list[Option]:
    """The leaves of ``schema``, depth first in field order."""
    found = []
    for field in msgspec.inspect.type_info(schema).fields:
        t, description, extra = _unwrap(field.type)
        if isinstance(t, msgspec.inspect.StructType):
            prefix = extra.get("prefix", field.name + "_")
            found += options(t.cls, (*_path, field.name), _key + prefix)
            continue
        found.append(Option((*_path, field.name), _key + field.name, t, field.required, _default(field), description, extra))
    return found


def unflatten(schema: type, values: dict[tuple[str, ...], Any], base: dict | None = None) -> dict:
    """Plain data for ``schema`` from leaf values by path, over ``base``. A nested struct that
    has a default instance starts from it, so setting one of its fields keeps the others'."""
    data = dict(base or {})
    for field in msgspec.inspect.type_info(schema).fields:
        t, _, _ = _unwrap(field.type)
        if isinstance(t, msgspec.inspect.StructType):
            inner = {path[1:]: value for path, value in values.items() if path[0] == field.name}
            if inner:
                default = _default(field)
                below = data.get(field.name) or (msgspec.to_builtins(default) if isinstance(default, msgspec.Struct) else {})
                data[field.name] = unflatten(t.cls, inner, below)
        elif (field.name,) in values:
            data[field.name] = values[(field.name,)]
    return data


def convert_options(
    schema: type, values: dict[tuple[str, ...], Any], name: Callable[[Option], str], strict: bool = True
) -> Any:
    """``schema`` from leaf values by path; an error names the option as ``name(option)`` does.
    ``strict=False`` also takes numbers and booleans written as strings (a command line's)."""
    try:
        return msgspec.convert(unflatten(schema, values), schema, strict=strict)
    except msgspec.ValidationError as exc:
        message = str(exc)
        where = message.rpartition(" - at `")[2].rstrip("`")
        for option in sorted(options(schema), key=lambda o: -len(o.json_path)):
            if where == option.json_path or where.startswith((option.json_path + ".", option.json_path + "[")):
                raise ConfigError(f"{name(option)}: {message}") from None
        raise ConfigError(message) from None


def _describe(option: Option) -> str:
    text = option.description
    if isinstance(option.type, msgspec.inspect.LiteralType):
        text += f" ({', '.join(map(str, option.type.values))})"
    if option.required:
        return text + " (required)"
    if option.default not in (None, "", [], msgspec.NODEFAULT):
        text += f" (default {option.default})"
    if "env" in option.extra:
        text += f" (or env {option.extra['env']})"
    return text


def json_object(text: str, what: str = "value") -> dict:
    """A JSON object given as text. Errors never echo the text: it may hold a secret."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{what} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what} must be a JSON object")
    return data


def add_flags(parser: argparse.ArgumentParser, schema: type) -> None:
    """One flag per option of ``schema``; a list of structs is a repeatable flag of JSON objects."""
    for option in options(schema):
        names = [option.flag, *option.extra.get("aliases", ())]
        common = {"dest": option.key, "default": argparse.SUPPRESS, "help": _describe(option)}
        if isinstance(option.type, msgspec.inspect.BoolType):
            parser.add_argument(*names, action=argparse.BooleanOptionalAction, **common)
        elif isinstance(option.type, msgspec.inspect.ListType):
            parser.add_argument(*names, action="append", metavar="JSON", type=_argparse_json, **common)
        else:
            parser.add_argument(*names, required=option.required and "env" not in option.extra, **common)


def _argparse_json(text: str) -> dict:
    try:
        return json_object(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def from_args(schema: type, args: argparse.Namespace, environ: Mapping[str, str]) -> Any:
    """``schema`` from the flags ``add_flags`` made (and the environment variables they name)."""
    values = {}
    for option in options(schema):
        if option.key in args:
            values[option.path] = getattr(args, option.key)
        elif "env" in option.extra and option.extra["env"] in environ:
            values[option.path] = environ[option.extra["env"]]
    return convert_options(schema, values, lambda option: option.flag, strict=False)
