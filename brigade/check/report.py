"""What `brigade check` prints for one case: the verdict and layout, the largest differences, and
(when it fails across device kinds) why that may not be the pipeline's fault."""

from __future__ import annotations

from brigade.check.config import CheckConfig


def lines(cfg: CheckConfig, result: dict) -> list[str]:
    """The console lines for `result` (a `CheckResult.to_dict()`) of a check run with `cfg`."""
    verdict = "OK" if result["ok"] else "MISMATCH"
    sharded = f" (shard {cfg.shard})" if cfg.shard > 1 else ""
    sharded += f", tp={cfg.tp}" + (" (sequence parallel)" if result.get("sequence_parallel") else "") \
        if cfg.tp > 1 else ""
    sharded += f", ep={cfg.ep}" if cfg.ep > 1 else ""
    sharded += f", cp={cfg.cp} ({result.get('cp_method')})" if cfg.cp > 1 else ""
    sharded += f", recompute {cfg.recompute}" if cfg.recompute != "none" else ""
    sharded += f", LoRA rank {cfg.lora}" if cfg.lora else ""
    out = [f"{verdict}: {cfg.model} on {cfg.stages} stages ({cfg.runtime}), {cfg.schedule}, "
           f"V={result['virtual']}, dp={cfg.dp}{sharded}, m={cfg.microbatches}, "
           f"balance {result['balance']}, reference: {result['reference']} on {result['reference_device']}",
           f"  max |Δloss| {result['max_abs_loss_diff']:.3g}   max |Δgrad| "
           f"{result['max_abs_grad_diff']:.3g}   max |Δparam| after one SGD step "
           f"{result['max_abs_param_diff']:.3g}   (tolerance {cfg.atol:g})"]
    if not result["ok"] and len({d.split(":")[0] for d in cfg.devices or []}) > 1:
        out.append("  the stages run on a CPU and a GPU, whose fp32 arithmetic rounds differently: check "
                   "on one kind of device to separate that from the pipeline, or raise --atol")
    return out
