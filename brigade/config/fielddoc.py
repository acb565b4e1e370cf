"""One sentence per configuration field, written where the field is declared.

    n_layer: int = doc(4, "transformer blocks")

`doc` is `dataclasses.field` with the sentence in the field's `metadata["help"]`, so every place
that shows a field reads the same words: `brigade train --help` (`sources.add_flags`), the comment
above each key of the TOML file `to_toml` writes, and the flags of the other commands whose options
are a documented dataclass (`check.CheckConfig`, `doctor.Setup`). A sentence says what 0 or empty
means where it means "derive it" or "the schedule's own".

A field whose values are a registry's (schedules, models, precisions) names it with `choices`:
the list is asked of its owner when help or a file is written, never copied here.

Why field metadata: argparse cannot see a `# comment`; attribute docstrings would need the
source file at run time and an `ast` pass to pair each string with its field (a second parser to
keep right, and nothing when the package is installed without sources); tyro would generate the
whole CLI but is a new dependency and respells flags and booleans (`--parallel.pp`,
`--model.tie-embeddings False`) that users, tests and saved commands rely on. `metadata` is the
standard library's own slot for this, read back by `dataclasses.fields`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

HELP, CHOICES = "help", "choices"


@dataclass(frozen=True)
class Choices:
    """Where a field's values are listed: functions of their owner, called only when shown.

    names: the accepted values; more: what else is accepted, like "path/to/file.py:factory";
    described: what each value does, for --help (None: the names). Without names, `described`
    is the text both ways (the V of each schedule, say).
    """

    names: Callable[[], Iterable[str]] | None = None
    described: Callable[[], str] | None = None
    more: str = ""

    def short(self) -> str:
        """``"gpipe, 1f1b or zb"``: the values, as a TOML comment lists them."""
        if self.names is None:
            return self.described() if self.described else ""
        *rest, last = [*self.names(), *([self.more] if self.more else [])]
        return f"{', '.join(rest)} or {last}" if rest else last

    def long(self) -> str:
        """The values with what each does, for a flag's help."""
        return self.described() if self.described is not None else self.short()


def doc(default: Any = dataclasses.MISSING, help: str = "", *,  # noqa: A002 -- argparse's word
        factory: Callable[[], Any] | None = None, choices: Choices | None = None) -> Any:
    """A dataclass field with its one-sentence documentation.

    Args:
        default: the field's default (leave it out and give `factory` for a mutable one).
        help: one sentence: what the value means, and what 0 or empty means where it is special;
            with `choices`, "{choices}" marks where they go (else they follow a colon).
        factory: `default_factory`, for lists and dicts.
        choices: where the accepted values are listed (`Choices`).

    Raises:
        ValueError: an empty sentence (every field explains itself).
    """
    if not help.strip():
        raise ValueError("doc(): give the field a sentence that says what it means")
    metadata = {HELP: help, **({CHOICES: choices} if choices else {})}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def field_of(cls: type, name: str) -> dataclasses.Field:
    """The field `name` of dataclass `cls`.

    Raises:
        KeyError: `cls` has no such field.
    """
    found = {f.name: f for f in dataclasses.fields(cls)}
    if name not in found:
        raise KeyError(f"{cls.__name__} has no field {name!r}: expected one of {', '.join(found)}")
    return found[name]


def sentence(cls: type, name: str) -> str:
    """The bare sentence of `cls.name`, for a field elsewhere that means the same thing."""
    return field_of(cls, name).metadata.get(HELP, "")


def help_of(f: dataclasses.Field, long: bool = True) -> str:
    """A field's sentence and, if it has `choices`, the values (`long`: with what each does).

    Returns "" for an undocumented field, which the CLI's test refuses.
    """
    text = f.metadata.get(HELP, "")
    choices = f.metadata.get(CHOICES)
    if choices is None:
        return text
    listed = choices.long() if long else choices.short()
    return text.replace("{choices}", listed) if "{choices}" in text else f"{text}: {listed}"


def default_of(f: dataclasses.Field) -> Any:
    """A field's default value (its factory's result for a list or dict)."""
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else None


def flag_help(f: dataclasses.Field, default: Any = dataclasses.MISSING) -> str:
    """`help_of(f)` then its default, ready for argparse (a literal % doubled).

    Args:
        default: the default to show; by default the field's. None shows no default.
    """
    shown = default_of(f) if default is dataclasses.MISSING else default
    text = help_of(f) + ("" if shown is None else f" (default: {shown!r})")
    return text.replace("%", "%%")


def _schedule_names() -> list[str]:
    from brigade.pipeline.plans import schedule  # the registry owns the names and each one's V

    return schedule.names()


def _schedule_help() -> str:
    from brigade.pipeline.plans import schedule

    return schedule.help_text()


def _schedule_virtuals() -> str:
    """``"gpipe, 1f1b and zb run 1; interleaved and looped-bfs any V, 2 unless asked; ..."``."""
    from brigade.pipeline.plans import schedule

    runs: dict[str, list[str]] = {}
    for s in schedule.SCHEDULES.values():
        v = str(s.virtual) if s.virtual else f"any V, {schedule.DEFAULT_VIRTUAL} unless asked" \
            if not s.most_virtual else f"1 to {s.most_virtual}, {schedule.DEFAULT_VIRTUAL} unless asked"
        runs.setdefault(v, []).append(s.name)
    (first, names), *rest = runs.items()
    verb = "runs" if len(names) == 1 else "run"
    return "; ".join([f"{_and(names)} {verb} {first}", *(f"{_and(n)} {v}" for v, n in rest)])


def _and(names: list[str]) -> str:
    *rest, last = names
    return f"{', '.join(rest)} and {last}" if rest else last


def _model_names() -> tuple[str, ...]:
    from brigade.models import BUILTIN  # the model registry owns the names

    return BUILTIN


def _recompute_names() -> list[str]:
    from brigade.config.recompute import MODES  # owns the names and what each does

    return list(MODES)


def _recompute_help() -> str:
    from brigade.config.recompute import MODES

    return "; ".join(f"{name}: {what}" for name, what in MODES.items())


def _precision_names() -> list[str]:
    from brigade.config.precision import PRECISIONS  # owns the names it accepts

    return list(PRECISIONS)


def _update_names() -> list[str]:
    from brigade.config.optimizer import UPDATES  # owns the names and what each does

    return list(UPDATES)


def _update_help() -> str:
    from brigade.config.optimizer import UPDATES

    return "; ".join(f"{name}: {what}" for name, what in UPDATES.items())


def _lr_schedule_names() -> list[str]:
    from brigade.config.lr import LR_SCHEDULES  # owns the names and what each does

    return list(LR_SCHEDULES)


def _lr_schedule_help() -> str:
    from brigade.config.lr import LR_SCHEDULES

    return "; ".join(f"{name}: {what}" for name, what in LR_SCHEDULES.items())


def _float8_names() -> list[str]:
    from brigade.config.precision import FLOAT8_RECIPES  # owns the recipes (torchao's names)

    return list(FLOAT8_RECIPES)


def _chunked_loss_names() -> list[str]:
    from brigade.config.loss import MODES  # owns the names and what each does

    return list(MODES)


def _chunked_loss_help() -> str:
    from brigade.config.loss import MODES

    return "; ".join(f"{name}: {what}" for name, what in MODES.items())


SCHEDULES = Choices(_schedule_names, _schedule_help)
VIRTUALS = Choices(described=_schedule_virtuals)
MODELS = Choices(_model_names, more="path/to/file.py:factory, hf:DIR (a Hugging Face directory)")
PRECISIONS = Choices(_precision_names)
RECOMPUTES = Choices(_recompute_names, _recompute_help)
UPDATES = Choices(_update_names, _update_help)
LR_SCHEDULES = Choices(_lr_schedule_names, _lr_schedule_help)
FLOAT8 = Choices(_float8_names)
CHUNKED_LOSS = Choices(_chunked_loss_names, _chunked_loss_help)


def _cp_method_names() -> list[str]:
    from brigade.config.context import METHODS  # owns the names

    return list(METHODS)


CP_METHODS = Choices(_cp_method_names)
SNAPSHOT_ERRORS = Choices(lambda: ("stop", "warn"))
LOGS = Choices(lambda: ("tensorboard", "wandb", "mlflow"))  # train.metrics and train.trackers write them
