"""A shared parameter (a tied embedding and head) is stored once, under its canonical name.

A model's state names a tie under each of its uses: `blocks.0.tok.weight` and its alias
`blocks.3.out.weight`, one object (one process) or one copy per stage
(`pipeline.stages.ties.StageTies`). The optimizer's flattened state names it likewise
(`state.blocks.3.out.weight.exp_avg`). A snapshot drops every alias key; a loader reads the
canonical entry, into the alias's tensor when this rank holds only the alias, and fills every
alias from it: so a snapshot resumes in any layout.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

_PREFIXES = ("", "state.", "param_groups.")  # model keys; flattened optimizer keys


def aliases_of(model: nn.Module) -> dict[str, str]:
    """Alias parameter name → canonical name, for `model`'s shared parameters.

    Found by identity (one Parameter under two names), plus the module's own `aliases`
    attribute where it has one (`parallel.assemble.OwnedBlocks`: copies on different stages are
    different objects, so identity cannot tell).
    """
    first: dict[int, str] = {}
    found: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        canonical = first.setdefault(id(p), name)
        if canonical != name:
            found[name] = canonical
    found.update(getattr(model, "aliases", None) or {})
    return found


def canonical_key(key: str, aliases: Mapping[str, str]) -> str | None:
    """The canonical key for a model or flattened optimizer key naming an alias; None otherwise."""
    for prefix in _PREFIXES:
        if not key.startswith(prefix):
            continue
        rest = key[len(prefix):]
        for alias, canonical in aliases.items():
            if rest == alias or rest.startswith(alias + "."):
                return prefix + canonical + rest[len(alias):]
    return None


def stored(state: dict, aliases: Mapping[str, str]) -> dict:
    """`state` without its alias keys: what a snapshot writes.

    Every tie's canonical block is held by some rank of every layout, so dropping the aliases
    everywhere loses nothing.
    """
    return {k: v for k, v in state.items() if canonical_key(k, aliases) is None}


def to_load(state: dict, aliases: Mapping[str, str]) -> tuple[dict, dict[str, str]]:
    """The keys to read for `state` (canonical names only), and alias key → canonical key.

    A rank holding only an alias reads the canonical entry into the alias's own tensor; the
    canonical key is then this rank's to drop again (`filled`): the mapping's value is prefixed
    with `BORROWED`.
    """
    template: dict = {}
    fill: dict[str, str] = {}
    for key, value in state.items():
        canonical = canonical_key(key, aliases)
        if canonical is None:
            template[key] = value
            continue
        fill[key] = canonical if canonical in state else BORROWED + canonical
        if canonical not in state:
            template.setdefault(canonical, value)
    return template, fill


BORROWED = "\0"  # marks a canonical key read for an alias only: no parameter name holds a NUL


def filled(template: dict, fill: Mapping[str, str]) -> dict:
    """The loaded `template` with every alias key given its canonical entry's value, and the
    canonical keys this rank does not hold dropped.

    Every key gets a tensor of its own: a rank holding two copies of a tie (the V placement's
    first and last stage, or local stages) must not hand both the same optimizer state, or each
    step updates that state once per copy (`step` counts 2, `exp_avg` moves twice) and the copies
    drift apart from the run that never stopped.
    """
    borrowed = {c.removeprefix(BORROWED) for c in fill.values() if c.startswith(BORROWED)}
    out = {k: v for k, v in template.items() if k not in borrowed}
    taken = {id(v) for v in out.values()}
    for alias, canonical in fill.items():
        value = template[canonical.removeprefix(BORROWED)]
        if isinstance(value, torch.Tensor) and id(value) in taken:
            value = value.clone()
        taken.add(id(value))
        out[alias] = value
    return out
