"""Where a run configuration comes from, and how it is written back.

Sources, later wins: the defaults here, a TOML file (`--config run.toml`, one
table per section), then command-line flags. Flags are generated from the
fields: `ParallelConfig.microbatches` is `--microbatches`, `TrainConfig.max_steps`
is `--max-steps`. Every field name is unique across sections, so flags stay flat.

    [parallel]
    nproc = 2
    pp = 2
    [train]
    max_steps = 500
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import types
import typing
from dataclasses import fields
from pathlib import Path

from brigade.config import elastic
from brigade.config.fielddoc import flag_help, help_of
from brigade.config.resolve import Launched, resolve_layout
from brigade.config.sections import SECTIONS, RunConfig, field_types, section_classes
from brigade.config.validate import validate
from brigade.errors import BrigadeError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def _coerce(value: object, kind: type, where: str) -> object:
    """Check a TOML value against the field's type (ints are accepted for floats)."""
    if isinstance(kind, types.UnionType):
        kind = next(a for a in typing.get_args(kind) if a is not type(None))
    ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not ok:
        raise BrigadeError(f"{where} = {value!r} is a {type(value).__name__}, expected {kind.__name__}: "
                           "fix it in the file")
    return value


# Keys a TOML file may give as a table: --data's mixture, {path = weight, ...}, is its string
# `path:weight,...` (`data.mix`) there.
TABLES = {("data", "data")}


def _mixture(table: dict, where: str) -> str:
    """A mixture's TOML table `{"web.txt" = 0.7, "code.txt" = 0.3}` as --data's `web.txt:0.7,code.txt:0.3`.

    Raises:
        BrigadeError: a weight that is not a number.
    """
    for corpus, weight in table.items():
        if isinstance(weight, bool) or not isinstance(weight, int | float):
            raise BrigadeError(f"{where}: corpus {corpus!r} has weight {weight!r}: a mixture's table maps "
                               "each path to a number, as data = {\"a.txt\" = 0.7, \"b.txt\" = 0.3}")
    return ",".join(f"{corpus}:{weight}" for corpus, weight in table.items())


def load_toml(path: str | Path) -> dict[str, dict]:
    """Read and check a TOML config: known sections and keys, right types.

    Raises:
        BrigadeError: missing or malformed file, unknown section or key, wrong type.
    """
    path = Path(path)
    if not path.is_file():
        raise BrigadeError(f"config file {str(path)!r} not found: give the path to a .toml file")
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise BrigadeError(f"config file {path} is not valid TOML ({exc}): fix the syntax") from None
    classes = section_classes()
    out: dict[str, dict] = {}
    for section, table in raw.items():
        if section not in classes or not isinstance(table, dict):
            raise BrigadeError(f"{path}: unknown section [{section}]: expected one of {', '.join(classes)}")
        kinds = field_types(classes[section])
        for key, value in table.items():
            if key not in kinds:
                raise BrigadeError(f"{path}: unknown key {key!r} in [{section}]: expected one of "
                                   f"{', '.join(kinds)}")
            if (section, key) in TABLES and isinstance(value, dict):
                value = _mixture(value, f"{path}: [{section}] {key}")
            out.setdefault(section, {})[key] = _coerce(value, kinds[key], f"{path}: [{section}] {key}")
    return out


def add_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per field, default SUPPRESS so only what the user typed overrides; its help is
    the field's sentence (`fielddoc`) and default."""
    for section, cls in section_classes().items():
        group = parser.add_argument_group(section)
        for f in fields(cls):
            kind = field_types(cls)[f.name]
            flag = "--" + f.name.replace("_", "-")
            text = flag_help(f)
            if f.name == "nnodes":  # N, or MIN:MAX (parsed in `build`, so a mistake is one line)
                group.add_argument(flag, default=argparse.SUPPRESS, metavar="N|MIN:MAX", help=text)
            elif kind is bool:
                group.add_argument(flag, action=argparse.BooleanOptionalAction,
                                   default=argparse.SUPPRESS, help=text)
            else:
                group.add_argument(flag, type=kind, default=argparse.SUPPRESS, metavar=kind.__name__.upper(),
                                   help=text)
    parser.add_argument("--config", default=None, metavar="FILE.toml",
                        help="a TOML file of these settings, one [table] per group above, as a run "
                             "writes to OUT/config.toml; flags override it")


def build(args: argparse.Namespace | None = None, toml: dict[str, dict] | None = None,
          world: Launched | None = None) -> RunConfig:
    """Defaults ← TOML ← flags, then `validate`, then `resolve_layout` for `world`.

    Args:
        args: parsed flags (only those the user typed are present).
        toml: a loaded config file; by default the one `--config` names.
        world: the processes a launcher started (torchrun, srun); None: brigade starts
            `--nproc` × `--nnodes` itself.

    Raises:
        BrigadeError: a value out of range, or a layout that contradicts the world.
    """
    cfg = RunConfig()
    given = vars(args) if args is not None else {}
    if toml is None and given.get("config"):
        toml = load_toml(given["config"])
    for section, values in (toml or {}).items():
        for key, value in values.items():
            setattr(getattr(cfg, section), key, value)
    given = elastic.split_nnodes(given)  # --nnodes N or MIN:MAX → nnodes, min_nodes
    for section in SECTIONS:
        part = getattr(cfg, section)
        for f in fields(part):
            if f.name in given:
                setattr(part, f.name, given[f.name])
    validate(cfg)
    typed = {k for k in given if given[k] is not None} | set((toml or {}).get("parallel", {}))
    return resolve_layout(cfg, world, given=typed)


def _toml_value(value: object) -> str:
    """A value as TOML writes it: JSON's, but for booleans and infinities (`inf`, `-inf`)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return json.dumps(value)


def to_toml(cfg: RunConfig) -> str:
    """`cfg` as a TOML file that `load_toml` (and `--config`) reads back, each key under a comment
    that is its field's sentence (`fielddoc.help_of`, the words of `brigade train --help`)."""
    lines = []
    for section, cls in section_classes().items():
        part = getattr(cfg, section)
        lines.append(f"[{section}]")
        for f in fields(cls):
            value = getattr(part, f.name)
            text = _toml_value(value)
            lines.append("# " + " ".join(help_of(f, long=False).split()))
            lines.append(f"{f.name} = {text}")
        lines.append("")
    return "\n".join(lines)
