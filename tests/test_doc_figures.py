"""Every measured figure on the README and the docs pages below comes from a JSON file under results/.

What it holds: each page's prose (fenced code blocks, inline code spans and generated
`<!-- name -->...<!-- /name -->` blocks left out) is searched for measured figures: a number with a
unit (s, ms, µs, minutes, %, ×, GB/s, GiB, MiB, MB, GB, tokens/s, ...), a leading `×1.08`, lists
and ranges of them (`247, 170 and 179 ms`, `0.49–0.67 GB/s`), and the bare numbers of a table
column whose header names a unit (`tokenize (s)`, `peak GiB`). Each figure must be found among the
numbers of the JSON files under results/ at the precision it is written with, in a unit its key
declares (`step_s`, `peak_rss_bytes`, `max_rss_gib`) or none: `9.6 %` matches 0.0956, `130 ms`
matches a `_s` key's 0.12964, `387 MiB` matches 406245376 bytes, `6 %` faster matches a speed-up
of 1.0636. A time, a bandwidth or a rate matches only a key that declares one, so a loss or a count
never passes for a time. A figure that is not a measurement (a setting, a default, a limit, a goal,
a tolerance, arithmetic from shapes, a datasheet's figure) is listed in ALLOWED for its page, with
why.

Its limit: a figure is matched against every number of every file, not the one it quotes. It
catches a stale figure (the file was regenerated and the page was not) and an invented one (no
file holds it). It does not catch a figure quoted from the wrong row or file when some other number
rounds the same: a percentage or a ratio, which most fractions under results/ can be, or a figure
of few digits is checked weakly, one of many digits well. Nor does it see a figure written in words
("a third slower") or a bare number outside a table, and an ALLOWED figure is let through wherever
the page states it. docs/results.md's generated blocks, docs/testing.md and docs/schedules.md are
written from results/ and the registry, and their own tests guard them (tests/test_results.py,
tests/test_docs.py); what docs/results.md says by hand around its blocks is held here, with
nothing allowed but its targets.
"""

from __future__ import annotations

import bisect
import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"
PAGES = ["README.md", "docs/architecture.md", "docs/context-parallel.md", "docs/data.md",
         "docs/faults.md", "docs/gpu.md", "docs/multi-node.md", "docs/plan.md", "docs/speed.md",
         "docs/tensor-parallel.md", "docs/results.md"]

# The figures a page states that are not measurements, by page: the figure as the failure message
# names it (the number as written, then its unit), and why no results file need hold it. It lists
# every such figure the checker finds, also those some number of results/ happens to match.
ALLOWED: dict[str, dict[str, str]] = {
    "README.md": {},
    "docs/architecture.md": {
        "32 MiB": "malloc's setting: blocks up to 32 MiB come from the heap (host/malloc.py)",
    },
    "docs/context-parallel.md": {
        "64 MiB": "the memory limit the longest-sequence search holds each rank to (context.json's limit)",
        "2 MiB": "arithmetic: the position table at sequence 8,192, 8192 × 64 × 4 bytes",
        "8 MiB": "arithmetic: that table with its gradient and AdamW's two moments, four times 2 MiB",
    },
    "docs/data.md": {
        "256 KiB": "the reader's setting: how much of a text file it reads at a time",
        "1 MiB": "the tokenizer's setting: how much text it encodes per call",
        "10 MB": "a corpus size the benchmark generates (a setting)",
        "100 MB": "a corpus size the benchmark generates (a setting)",
        "1 GB": "a corpus size the benchmark generates (a setting)",
        "125 MB": "arithmetic: some 15 M windows × 8 bytes",
        "1 GiB": "data_scale's goal for a process's memory, not a measurement",
    },
    "docs/faults.md": {
        "30 s": "the default of --stop-grace",
        "30 minutes": "the example's --snapshot-minutes 30 (a setting)",
        "500 MB": "the size the stall benchmark's model is built to exceed (its setting)",
        "20 %": "the goal for a background snapshot's stall (snapshot_stall.json's goal), not a measurement",
    },
    "docs/gpu.md": {
        "150 s": "the timeout of gpu_context.py's queue (a setting)",
        "×8": "Llama 3.2 1B's rope scaling factor (a model setting)",
    },
    "docs/multi-node.md": {
        "15 s": "how long a node waits for the rendezvous endpoint (a setting)",
        "120 s": "the default of --rdzv-timeout",
        "10 s": "the default of --rdzv-last-call",
        "2 s": "torch's elastic heartbeat interval (a setting)",
        "1 s": "the doctor's limit on clock skew (a threshold)",
    },
    "docs/plan.md": {
        "50 %": "the MFU the formula assumes (a setting)",
        "140 GB": "the size of a 70B's published safetensors (an outside figure)",
        "10 %": "the accuracy benchmark's targets for the step median and memory, not measurements",
        "20 %": "the accuracy benchmark's target for the worst step, not a measurement",
        "80 GB": "an H100's memory (datasheet)",
        "96 GB": "the parts torchtitan measured on (an outside figure)",
        "4 GiB": "arithmetic: a Llama head's logits, 8192 × 128256 × 4 bytes",
        "28 GiB": "arithmetic: the states of 30.5 B parameters over 16 GPUs, 16 bytes each",
        "50 GB/s": "the network's datasheet bandwidth a GPU (planner/devices.py)",
        "16.8 MB": "arithmetic: the probe's 4 linear layers' gradients, from their shapes",
    },
    "docs/speed.md": {},
    # docs/results.md quotes its figures only in its generated blocks (brigade/results/page.py,
    # tests/test_results.py): what is written by hand around them states targets alone.
    "docs/results.md": {
        "×1.10": "the GPT's target for brigade's best against torch's best",
        "×1.05": "ResNet-50's target for brigade's auto against torch's best",
        "×1.20": "the MLP's target at m = 2, zero-bubble on both sides",
        "95 %": "the confidence of the bench's intervals (a setting)",
        "2 %": "the target for auto against the best schedule and against the balanced bound",
    },
    "docs/tensor-parallel.md": {
        "4 GiB": "arithmetic: a Llama head's logits, 8192 × 128K × 4 bytes",
    },
}

_NUM = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
_UNIT = (r"tokens/s(?:/GPU)?|tokens a second|GB/s|MB/s|GiB|MiB|KiB|GB|MB|kB|µs|us|ms|seconds?|s"
         r"|minutes?|min|hours?|%|×|x")
_SIGNED = rf"[−+]?{_NUM}"
_RANGE = rf"{_SIGNED}(?:\s*(?:–|-|/|to)\s*{_SIGNED})*"  # 0.49–0.67, 96 / 67, 1.2 to 1.6
_LIST = rf"{_RANGE}(?:,\s+{_RANGE})*,?\s+(?:and|or)\s+{_RANGE}"  # 247, 170 and 179
FIGURE = re.compile(
    rf"(?<![\w.,/−+×-])×(?P<lead>{_NUM})(?![\w.])"
    rf"|(?<![\w.,/−+×-])(?P<nums>{_LIST}|{_RANGE})"
    rf"(?:\s?(?P<mult>[kM])(?=\stoken))?\s?(?P<unit>{_UNIT})(?![\w/])")
_HEADER_UNIT = re.compile(rf"(?<![\w/'’])({_UNIT})(?![\w/])")
_CELL = re.compile(rf"^\s*(?P<num>[−+]?{_NUM})(?:\s(?P<mult>[kM]))?\s*$")
_CANON = {"x": "×", "second": "s", "seconds": "s", "us": "µs", "minute": "minutes", "min": "minutes",
          "hour": "hours", "tokens a second": "tokens/s", "tokens/s/GPU": "tokens/s"}
_MiB, _GiB = 2.0 ** 20, 2.0 ** 30
# The unit a JSON key declares, by one of its words (`step_s`, `peak_rss_bytes`, `max_rss_gib`,
# `all_reduce_bw` in bytes/s); a key that declares none (`ratio`, `peak`, `mfu`) inherits its
# parent's (`memory_gib: {peak: ...}`), else it is undeclared ("").
_KEY_UNITS = (("bytes", "bytes"), ("mib", "MiB"), ("gib", "GiB"), ("mb", "MB"), ("gbps", "GB/s"),
              ("bw", "B/s"), ("ms", "ms"), ("s", "s"), ("seconds", "s"))
# A figure in this unit (the key) is backed by a value of one of these kinds times the factor:
# `387 MiB` by bytes ÷ 2**20, `130 ms` by seconds × 1e3, `9.6 %` by an undeclared fraction × 100.
# Time, bandwidth and tokens/s only from keys that declare them, so that a loss or a count never
# passes for a time.
SCALES: dict[str, tuple[tuple[str, float], ...]] = {
    "s": (("s", 1), ("ms", 1e-3)), "ms": (("s", 1e3), ("ms", 1)), "µs": (("s", 1e6), ("ms", 1e3)),
    "minutes": (("s", 1 / 60),), "hours": (("s", 1 / 3600),),
    "%": (("", 100),), "×": (("", 1),), "": (("", 1),), "tokens/s": (("tokens/s", 1),),
    "GB/s": (("B/s", 1e-9), ("GB/s", 1)), "MB/s": (("B/s", 1e-6),),
    "GiB": (("bytes", 1 / _GiB), ("count", 1 / _GiB), ("", 1 / _GiB), ("GiB", 1), ("MiB", 1 / 1024)),
    "MiB": (("bytes", 1 / _MiB), ("count", 1 / _MiB), ("", 1 / _MiB), ("MiB", 1), ("GiB", 1024)),
    "KiB": (("bytes", 1 / 1024), ("count", 1 / 1024)),
    "GB": (("bytes", 1e-9), ("count", 1e-9), ("", 1e-9), ("MB", 1e-3)),
    "MB": (("bytes", 1e-6), ("count", 1e-6), ("", 1e-6), ("MB", 1)), "kB": (("bytes", 1e-3), ("count", 1e-3)),
}


@dataclass(frozen=True)
class Figure:
    """One number a page states: as written (`text`), its value, decimals, unit and sentence."""

    text: str
    value: float
    decimals: int
    unit: str
    sentence: str

    @property
    def key(self) -> str:
        """How ALLOWED and the failure message name it: `387 MiB`, `×1.08`, `1.2 ×`."""
        return f"×{self.text}" if self.unit == "lead×" else f"{self.text} {self.unit}".strip()


def _number(text: str) -> tuple[float, int]:
    """A number as written (`−6.8`, `10,703`) → its value and its decimals, the precision it claims."""
    plain = text.replace(",", "").replace("−", "-")
    return float(plain), len(plain.partition(".")[2])


def _key_unit(key: str | None, inherited: str) -> str:
    """The unit a JSON key declares by one of its words, else its parent's (see _KEY_UNITS)."""
    if key in ("events", "ts", "dur", "pid", "tid"):  # a timeline's clock readings: no page quotes them
        return "trace"
    words = (key or "").lower().split("_")
    if "tokens" in words:
        return "tokens/s" if "per" in words and "s" in words else inherited
    return next((unit for word, unit in _KEY_UNITS if word in words), inherited)


@functools.lru_cache(maxsize=1)
def _values() -> dict[str, tuple[float, ...]]:
    """Every number of every JSON file under results/, as sorted absolute values by the unit its
    key declares (read once: each page's check bisects these instead of walking the files)."""
    found: dict[str, list[float]] = {}

    def walk(node, unit: str) -> None:
        if isinstance(node, bool):
            return
        if isinstance(node, (int, float)):
            kind = "count" if unit == "" and isinstance(node, int) else unit
            found.setdefault(kind, []).append(abs(float(node)))
        elif isinstance(node, dict):
            for key, item in node.items():
                walk(item, _key_unit(key, unit))
        elif isinstance(node, list):
            for item in node:
                walk(item, unit)

    for path in sorted(RESULTS.rglob("*.json")):
        walk(json.loads(path.read_text(encoding="utf-8")), "")
    return {unit: tuple(sorted(values)) for unit, values in found.items()}


def _held(kind: str, lo: float, hi: float) -> bool:
    """Whether some value of results/ whose key declares `kind` lies in [lo, hi]."""
    values = _values().get(kind, ())
    at = bisect.bisect_left(values, lo)
    return at < len(values) and values[at] <= hi


def backed(figure: Figure) -> bool:
    """Whether results/ holds a number that rounds to the figure at the decimals it is written
    with, in a unit the figure's converts from (SCALES), or, for a percentage, an undeclared
    ratio whose change it is (a speed-up of 1.064 is `6 %` faster)."""
    target, unit = abs(figure.value), ("×" if figure.unit == "lead×" else figure.unit)
    tol = 0.5 * 10.0 ** -figure.decimals * (1 + 1e-9) + 1e-12
    if any(_held(kind, (target - tol) / factor, (target + tol) / factor) for kind, factor in SCALES[unit]):
        return True
    low, high = (target - tol) / 100, (target + tol) / 100
    return unit == "%" and (_held("", 1 + low, 1 + high) or _held("", 1 - high, 1 - low))


def prose(text: str) -> str:
    """The page without what is not prose: generated blocks (another test owns them), fenced code
    blocks (commands and example output, whose numbers are illustrative) and inline code spans
    (flags, file names and quoted output lines)."""
    text = re.sub(r"<!--\s*([\w-]+)[^>]*?-->.*?<!--\s*/\1\s*-->", "", text, flags=re.S)
    text = re.sub(r"^[ \t]*(```|~~~).*?^[ \t]*\1[ \t]*$", "", text, flags=re.S | re.M)
    return re.sub(r"(`+)[^`]*?\1", "`…`", text)


def _sentence(text: str, start: int, end: int) -> str:
    """The sentence (or the table row) around a match, on one line, for the failure message."""
    marks = (". ", "\n\n", "\n- ", "\n* ")
    line_start = text.rfind("\n", 0, start) + 1
    if text.startswith("|", line_start):
        line_end = text.find("\n", end)
        return text[line_start:line_end if line_end >= 0 else len(text)].strip()
    left = max(text.rfind(mark, 0, start) for mark in marks)
    right = min((i for i in (text.find(mark, end) for mark in marks) if i >= 0), default=len(text))
    return " ".join(text[left + 1:right + 1].split())[:300]


def _inline_figures(text: str) -> list[Figure]:
    """The numbers with a unit in running text (tables included): `2.29 s`, `×0.51`, the members
    of `247, 170 and 179 ms`. A trailing × on whole numbers is a layout (`dp 2 × pp 2`), not a
    ratio, and is skipped."""
    figures = []
    for match in FIGURE.finditer(text):
        sentence = _sentence(text, match.start(), match.end())
        if match["lead"]:
            value, decimals = _number(match["lead"])
            figures.append(Figure(match["lead"], value, decimals, "lead×", sentence))
            continue
        unit = _CANON.get(match["unit"], match["unit"])
        numbers = re.findall(_SIGNED, match["nums"])
        # `pp 2, and 21.1 %` is a layout's degree before a figure: a list or range's figures
        # share their precision, so a member written otherwise than the last is not one of them.
        numbers = [n for n in numbers if _number(n)[1] == _number(numbers[-1])[1]]
        if unit == "×" and not any("." in n for n in numbers):
            continue
        scale = {"k": 1e3, "M": 1e6}.get(match["mult"] or "", 1.0)
        for written in numbers:
            value, decimals = _number(written)
            shown = f"{written} {match['mult']}" if match["mult"] else written
            figures.append(Figure(shown, value * scale, decimals - {1e3: 3, 1e6: 6}.get(scale, 0),
                                  unit, sentence))
    return figures


def _table_figures(text: str) -> list[Figure]:
    """The bare numbers of a table whose column header names a unit (`tokenize (s)`, `peak GiB`,
    `tokens/s per GPU`), and the bare decimals of any other column (ratios such as `0.528`)."""
    figures, header = [], None
    for line in text.splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = [(_HEADER_UNIT.search(c) or [None, None])[1] for c in cells]
            continue
        for cell, unit in zip(cells, header):
            match = _CELL.match(cell)
            if not match or (unit is None and "." not in match["num"]):
                continue
            value, decimals = _number(match["num"])
            scale = {"k": 1e3, "M": 1e6}.get(match["mult"] or "", 1.0)
            decimals -= {1e3: 3, 1e6: 6}.get(scale, 0)
            unit = _CANON.get(unit, unit) if unit else ""
            figures.append(Figure(cell, value * scale, decimals, unit, line.strip()[:300]))
    return figures


def figures(text: str) -> list[Figure]:
    """Every measured figure a page's prose states (see the module's docstring for what counts)."""
    kept = prose(text)
    return _inline_figures(kept) + _table_figures(kept)


def unbacked(page: str, text: str) -> list[str]:
    """One line per figure of `text` that no JSON file under results/ holds and ALLOWED does not
    list for `page`: the page, the figure and its sentence, and what to do."""
    allowed = ALLOWED.get(page, {})
    return [f"{page}: {f.key!r} is in no JSON file under results/ — in: {f.sentence}\n"
            f"    fix: regenerate the results file and quote it, or reword the sentence without the "
            f"number; if it is not a measurement, add it to ALLOWED[{page!r}] with why"
            for f in figures(text) if f.key not in allowed and not backed(f)]


@pytest.mark.parametrize("page", PAGES)
def test_every_measured_figure_of_a_page_is_in_a_results_file(page):
    """A page may quote results/, never restate a run from memory: a figure no file holds is stale
    (the file was regenerated) or was never measured by a command anyone can run again."""
    problems = unbacked(page, (ROOT / page).read_text(encoding="utf-8"))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", PAGES)
def test_every_allowed_figure_is_still_on_its_page(page):
    """An ALLOWED entry whose figure left the page would let the same figure back in unchecked."""
    keys = {f.key for f in figures((ROOT / page).read_text(encoding="utf-8"))}
    stale = sorted(set(ALLOWED[page]) - keys)
    assert not stale, f"{page}: ALLOWED lists {stale}, no longer on the page: remove them"


def test_the_checker_reports_an_invented_figure_and_passes_a_measured_one():
    """The guard can fail: a made-up step time is reported with its page and sentence, while
    hang.json's stall (10.2 s) and the data benchmark's 387 MiB (bytes in the file) pass."""
    made_up = "On 2 cores the GPT's step took 987.6543 ms with fused AdamW. The hang showed after 10.2 s."
    problems = unbacked("docs/speed.md", made_up)
    assert len(problems) == 1, problems
    assert "docs/speed.md" in problems[0] and "'987.6543 ms'" in problems[0]
    assert "the GPT's step took 987.6543 ms" in problems[0] and "ALLOWED" in problems[0]
    assert not unbacked("docs/data.md", "Each process peaked at 387 MiB, ×1.08 from 10 MB to 1 GB.")
    in_code = "```\nstep took 987.6543 ms\n```\nand `987.6543 ms` inline"
    assert not figures(in_code), "code blocks and inline code are not prose"
