"""bench.json's figures from the worker's per-round times: medians, per-round ratios, their CIs.

Every comparison is a ratio taken within a round (both sides timed minutes, not hours, apart)
and summarised by the median over rounds with an order-statistic confidence interval
(`stats.median_ci`, 95 %). A comparison whose interval contains 1, or taken over fewer than 6
rounds (too few for a 95 % interval), cannot rank its two sides: its `*_ranked` field is
False, and `brigade bench` says so instead of naming a winner.

    round k:  single_k  ours_k  torch_k  ideal_k (simulate() on round k's stage costs)
    speedup_vs_single = median_k(single_k / ours_k)     efficiency = median_k(ideal_k / ours_k)
    vs_torch          = median_k(torch_k / ours_k)      (> 1: brigade faster)

How far any schedule could go (transfers free, `bounds.lower_bound`): each brigade row's
`lower_bound_s` over its own cut and placement (auto's row: the cut it chose, and its
`cut_search`), and `balanced_bound_s`, its compute spread evenly over the ranks (any cut, any
V). The best pair's `bound_vs_torch` and `balanced_bound_vs_torch` divide torch's best step by
the lowest of them: a brigade step ×X faster than torch's best needs X below these.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict

from brigade.bench.cases import MP, OURS, PEER, SINGLE, BenchConfig, Case, Shape, shape_of
from brigade.bench.peers import TORCH_SCHEDULES
from brigade.measure.stats import median_ci, median_ci_coverage, ratio_ci
from brigade.pipeline.plans.bounds import balanced_bound, lower_bound
from brigade.pipeline.plans.schedule import build, names
from brigade.pipeline.plans.simulate import simulate

CONFIDENCE = 0.95
CI_METHOD = "order-statistic (binomial) CI of the median of per-round values, 95 %"


def _ideal_rounds(schedule: str, ranks: int, virtual: int, m: int, costs: list,
                  planned=None) -> list[float]:
    """Per round, the makespan simulate() gives brigade's `schedule` plan on that round's costs
    (a costed schedule's plan: the one it ran, planned on `planned`)."""
    plan = build(schedule, ranks, m, virtual, planned)
    return [simulate(plan, fwd, bwd, weight=wgt, input_grad=ing).makespan for fwd, bwd, wgt, ing in costs]


def _bound_rounds(schedule: str, ranks: int, virtual: int, m: int, costs: list, planned=None) -> dict:
    """Per round, the fastest any plan could be over this cut and placement, and over any cut."""
    plan = build(schedule, ranks, m, virtual, planned)
    return {f"{bound.__name__}_s": statistics.median(bound(plan, f, b, weight=w, input_grad=i)
                                                     for f, b, w, i in costs)
            for bound in (lower_bound, balanced_bound)}


def _twin(case: Case) -> Case | None:
    """The row `case` is compared with: brigade's row ↔ torch's, by the peers table."""
    if case.name == OURS:
        peer = [n for n, s in TORCH_SCHEDULES.items() if s.twin == case.schedule]
        return Case(PEER, peer[0], case.virtual, case.microbatches) if peer else None
    if case.name == PEER and TORCH_SCHEDULES[case.schedule].twin:
        return Case(OURS, TORCH_SCHEDULES[case.schedule].twin, case.virtual, case.microbatches)
    return None


def _ci(numerators: list[float], denominators: list[float], prefix: str) -> dict:
    """`prefix` = the median per-round ratio, its CI, and whether it ranks the two sides: only when
    the CI excludes 1 and there are rounds enough for the CI to hold its confidence (6 or more)."""
    value, lo, hi = ratio_ci(numerators, denominators, CONFIDENCE)
    sure = median_ci_coverage(len(denominators), CONFIDENCE) >= CONFIDENCE
    return {prefix: value, f"{prefix}_ci": [lo, hi], f"{prefix}_ranked": sure and not lo <= 1 <= hi}


def _timing(times: list[float]) -> dict:
    median, lo, hi = median_ci(times, CONFIDENCE)
    return {"mean_s": statistics.fmean(times), "std_s": statistics.stdev(times) if len(times) > 1 else 0.0,
            "median_s": median, "median_ci": [lo, hi], "rounds_s": times}


def _ideal(case: Case, raw: dict) -> tuple[str | None, list[float] | None]:
    """The brigade schedule whose plan is this row's ideal, and its per-round ideal seconds."""
    schedule = case.schedule if case.name in (OURS, MP) else (_twin(case) or Case("", None, 0, 0)).schedule
    costs = raw["costs"].get(shape_of(case))
    if schedule not in names() or not costs:
        return None, None  # a torch-only schedule: brigade has no plan to simulate
    planned = raw.get("plan_costs", {}).get(shape_of(case))
    return schedule, _ideal_rounds(schedule, raw["ranks"], case.virtual, case.microbatches, costs, planned)


def _row(cfg: BenchConfig, case: Case, raw: dict) -> dict:
    times, single = raw["times"][case.key], raw["times"][Case(SINGLE, None, 1, 1).key]
    pipelined = case.name in (OURS, MP, PEER)
    row = {**asdict(case), "stages": raw["ranks"] * case.virtual if pipelined else 1,
           "split_size": math.ceil(cfg.batch_size / case.microbatches), **_timing(times),
           "torch_pipelining": case.name == PEER, "rounds": len(times),
           **_ci(single, times, "speedup_vs_single")}
    if case.name == SINGLE:
        row["speedup_vs_single_ranked"] = None  # itself, by definition 1
    if pipelined:
        row["balance"] = raw["balances"][shape_of(case)]
    if shape_of(case) in raw.get("cut_search", {}):
        row["cut_search"] = raw["cut_search"][shape_of(case)]
    if case.name == PEER:
        row["torch_class"] = TORCH_SCHEDULES[case.schedule].cls
    _, ideal = _ideal(case, raw)
    row["ideal_s"] = statistics.median(ideal) if ideal else None
    row["ideal_speedup"] = ratio_ci(single, ideal)[0] if ideal else (1.0 if case.name == SINGLE else None)
    row.update(_ci(ideal, times, "efficiency") if ideal else {"efficiency": None})
    if ideal and case.name in (OURS, MP):
        costs = raw["costs"][shape_of(case)]
        for k, what in enumerate(("forward", "backward", "weight", "input")):
            row[f"stage_{what}_s"] = [statistics.median(c[k][s] for c in costs) for s in range(row["stages"])]
        planned = raw.get("plan_costs", {}).get(shape_of(case))
        row.update(_bound_rounds(case.schedule, raw["ranks"], case.virtual, case.microbatches, costs,
                                 planned))
    if case.key in raw["memory"]:
        activations, row["memory_method"], params, grads = raw["memory"][case.key]
        row.update(peak_activation_bytes=activations, params_bytes=params, grads_bytes=grads)
    twin = _twin(case)
    if case.name == OURS and twin and twin.key in raw["times"]:
        row["torch_twin"] = twin.schedule
        row.update(_ci(raw["times"][twin.key], times, "vs_torch"))
    return row


def shape_name(shape: Shape) -> str:
    """bench.json's name of a cut: "V2 m8" (the solver's, shared), "V2 m8 auto" (auto's own)."""
    v, m, own = shape
    return f"V{v} m{m}" + (f" {own}" if own else "")


def best_vs_best(rows: list[dict], times: dict[str, list[float]]) -> dict | None:
    """brigade's fastest row against torch's fastest (by median), as a per-round ratio with its CI.

    Returns:
        {brigade, torch (each schedule, virtual, microbatches), vs_torch, vs_torch_ci,
        vs_torch_ranked, and where brigade's rows carry bounds bound_vs_torch and
        balanced_bound_vs_torch}, or None when either side has no row.
    """
    ours = [r for r in rows if r["name"] == OURS]
    theirs = [r for r in rows if r["name"] == PEER]
    if not ours or not theirs:
        return None
    a, b = (min(side, key=lambda r: r["median_s"]) for side in (ours, theirs))
    key = lambda r: Case(r["name"], r["schedule"], r["virtual"], r["microbatches"]).key  # noqa: E731
    pick = lambda r: {k: r[k] for k in ("schedule", "virtual", "microbatches", "median_s")}  # noqa: E731
    best = {"brigade": pick(a), "torch": {**pick(b), "torch_class": b["torch_class"]},
            **_ci(times[key(b)], times[key(a)], "vs_torch")}
    for field, name in (("lower_bound_s", "bound_vs_torch"), ("balanced_bound_s", "balanced_bound_vs_torch")):
        values = [r[field] for r in ours if r.get(field)]
        if values:
            best[name] = b["median_s"] / min(values)
    return best


def summarise(cfg: BenchConfig, raw: dict, device: str) -> dict:
    """bench.json: one row per configuration (see the module doc), the best pair, the trace."""
    rows = [_row(cfg, Case(**c), raw) for c in raw["cases"]]
    methods = sorted({m for _, m, *_ in raw["memory"].values()})
    return {"config": asdict(cfg), "device": device,
            "balances": {shape_name(k): b for k, b in raw["balances"].items()}, "configs": rows,
            "cut_search": {shape_name(k): found for k, found in raw.get("cut_search", {}).items()},
            "skipped": raw["skipped"], "best": best_vs_best(rows, raw["times"]),
            "confidence": CONFIDENCE, "ci_method": CI_METHOD, "rounds": cfg.rounds,
            "ci_coverage": median_ci_coverage(cfg.rounds, CONFIDENCE),
            "timeline": raw["trace"], "memory_method": ", ".join(methods),
            "freed_memory_kept": raw.get("freed_memory_kept")}

