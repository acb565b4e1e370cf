"""The full tier: which cases the README's `python -m pytest` leaves to `python -m pytest -m full`.

The default tier is the README's test command and has a target of 8 minutes on 2 cores, so
of a grid of equivalent cases (every layout of the trainer, every model and layout of the check
grid, every documented command) it runs one representative per class, and the rest of the grid
runs in the full tier, which CI (`.ci/run`) runs right after it: every proof still runs in CI,
and a subset of each runs first, fast. A case is in exactly one of the default, full, slow and
cuda tiers (`tests/test_tiers.py` holds that, and that nothing below is stale).

FULL names a test, by its file or by `file::function`, and beside it the cases of that test that
stay in the default tier: fnmatch patterns over the case's id (what pytest prints in brackets),
empty where the whole test is left to the full tier. A case added later to a grid named here
joins the full tier by construction; the default's representatives are chosen by hand, for
what they cover (a schedule with a split backward, V = 2, sharding, tp, ep, cp, bf16) and at the
measured cost of each (`results/testing/durations-default.json`). `tests/e2e/test_readme.py`
marks its own (every command of docs/ and the measured `brigade plan`: see `_param` there).

`--tiers-report FILE` writes each collected case's tier as JSON (`{node id: tier}`) and is what
`tests/test_tiers.py` and `scripts/durations.py --tiers` read.
"""

from __future__ import annotations

import fnmatch
import json
import re
from pathlib import Path

import pytest

TIERS = ("default", "full", "slow", "cuda")  # the markers, the last three run by `-m TIER`

TRAINER = "tests/train/test_trainer.py"
CHECK = "tests/check/test_run.py"
FAULTS = "tests/e2e/test_faults.py"
E2E_TRAIN = "tests/e2e/test_train.py"
PLANNER = "tests/planner"

FULL: dict[str, tuple[str, ...]] = {
    # The trainer's 20 steps per layout: a split backward under dp × pp, expert and context
    # parallel under a pipeline, bf16, accumulation under sharding (V = 2 under shard × pp and tp ×
    # pp are the full tier's: the README's own --shard and --tp commands train them by default).
    f"{TRAINER}::test_layouts_match_a_single_device": ("dp2xpp2-zb",),
    f"{TRAINER}::test_expert_parallel_layouts_match_a_single_device": (),
    f"{TRAINER}::test_expert_parallel_trains_in_bf16_as_fp32_does": (),
    f"{TRAINER}::test_context_parallel_layouts_match_a_single_device": ("cp2xpp2-zb",),
    f"{TRAINER}::test_context_parallel_trains_in_bf16_as_fp32_does": (),
    f"{TRAINER}::test_gradient_accumulation_matches_one_big_batch": (),
    f"{TRAINER}::test_zero_bubble_gradient_accumulation_under_data_parallel": (),
    # The check grid: every schedule × V × m for a user's model file sharded; the tied GPT's every
    # schedule runs in the default tier through the documented `brigade check` commands.
    f"{CHECK}::test_transparency_grid": ("user-shard2",),
    f"{CHECK}::test_tensor_parallel_2_by_pipeline_2_on_every_schedule": (),
    f"{CHECK}::test_tensor_parallel_with_sharding_and_pipeline_on_8_processes": (),
    f"{CHECK}::test_tensor_parallel_with_replicas_and_no_pipeline": (),
    f"{CHECK}::test_a_mixture_of_experts_equals_one_device_on_every_schedule": ("sharded-ep2",),
    f"{CHECK}::test_a_mixture_of_experts_under_tensor_parallel_equals_one_device_on_every_schedule": (),
    f"{CHECK}::test_llama_side_inputs_and_tied_head": ("2-process", "4-local"),
    f"{CHECK}::test_resharding_after_each_forward_equals_one_device": (),
    f"{CHECK}::test_llama_sharded_with_selective_recompute": (),
    "tests/check/test_context.py::test_hf_llama_context_2_by_pipeline_2_on_every_schedule": (),
    "tests/check/test_context.py::test_gpt_context_2_by_pipeline_2_on_every_schedule": (),
    "tests/check/test_context.py::test_llama_context_2_by_tensor_2": (),
    "tests/check/test_hf.py::test_a_mixture_with_its_experts_split_over_ep_equals_transformers": (),
    # Faults and exact resume: a kill, a corrupt snapshot, a pickle with code, a non-finite loss,
    # SIGTERM; every schedule's exact resume under pp 2 (the dp × pp world in the full tier).
    # A kill at a step is the default tier's twice over (the README's own command, and pp 2's
    # exact-resume world killed through the CLI): the reference world's kill is the full tier's.
    f"{FAULTS}::test_kill_at_a_step": (),
    f"{FAULTS}::test_stall_is_caught_by_the_hang_timeout_and_restarted": (),
    f"{FAULTS}::test_kill_during_a_background_snapshot_write": (),
    f"{FAULTS}::test_hang_report_names_the_stalled_rank": (),
    f"{FAULTS}::test_rng_streams_after_resume_equal_uninterrupted": (),
    f"{FAULTS}::test_sigterm_exits_well_within_a_schedulers_grace": ("dp2xlocal2",),
    f"{FAULTS}::test_a_nan_loss_stops_the_run_at_that_step": ("dp2-rank1",),
    # pp 2's world in the default tier: a whole backward (1f1b) and a V with a split one (zbv);
    # its other schedules' runs are the full tier's, in a world of their own.
    "tests/e2e/test_exact_resume.py::test_a_stopped_run_resumes_bit_for_bit": ("pp2-1f1b", "pp2-zbv"),
    "tests/e2e/test_exact_resume.py::test_a_killed_run_restarted_by_the_agent_resumes_bit_for_bit": ("pp2",),
    # How a run is started: the README's Python example and `brigade train` stay; torchrun,
    # Slurm's variables and the agents on loopback are the full tier's.
    f"{E2E_TRAIN}::test_runs_under_slurm_variables": (),
    f"{E2E_TRAIN}::test_runs_under_torchrun": (),
    f"{E2E_TRAIN}::test_two_torchrun_agents_on_loopback": (),
    f"{E2E_TRAIN}::test_two_node_agents_on_loopback": (),
    f"{E2E_TRAIN}::test_a_single_node_run_listens_on_loopback_only": (),
    f"{E2E_TRAIN}::test_config_file_reproduces_the_run": (),
    f"{E2E_TRAIN}::test_runs_under_brigade_launch_from_python": (),
    "tests/e2e/test_hf.py": (),
    "tests/e2e/test_data.py": (),
    # Snapshots: a sharded one resumed under other layouts stays; tp's and ep's go.
    "tests/snapshot/test_sharded.py::test_a_tensor_parallel_snapshot_resumes_under_dp_pp_and_tp_alone": (),
    "tests/snapshot/test_sharded.py::test_an_expert_parallel_snapshot_resumes_under_other_expert_degrees": (),
    "tests/snapshot/test_format.py::test_a_run_resumes_from_the_snapshot_before_a_damaged_one": (),
    # The snapshot policies' edge cases (in flight at a stop, abandoned, rank 0's commit late, by
    # wall time, failed writes): one world of 2 processes, 40 s; the default tier snapshots and
    # resumes in its kill, stop and damaged-snapshot runs.
    "tests/train/test_snapshots.py": (),
    # The planner's measured costs (each measures a model on this machine): the formula's stay.
    f"{PLANNER}/test_command.py::test_a_model_whose_batch_is_a_structure_plans": ("formula",),
    f"{PLANNER}/test_command.py::test_the_table_names_its_columns_and_sources": (),
    f"{PLANNER}/test_command.py::test_json_then_write_config_that_train_runs_within_the_predicted_memory": (),
    f"{PLANNER}/test_costs.py::test_bf16_costs_are_timed_in_bf16_and_their_memory_in_fp32": (),
    f"{PLANNER}/test_budget.py::test_a_pipeline_holds_less_than_the_whole_model_and_1f1b_less_than_gpipe": (),
    f"{PLANNER}/test_budget.py::test_tune_never_times_what_would_not_fit_and_plans_auto_on_its_measured_costs": (),
    f"{PLANNER}/test_formula.py::test_shapes_give_what_a_split_backward_keeps_from_i_to_w": (),
    f"{PLANNER}/test_formula.py::test_shapes_give_the_flops_and_at_least_the_bytes_a_real_run_measures": (),
    f"{PLANNER}/test_memory.py::test_kept_is_the_gradient_at_each_weights_output_and_under_recompute_what_i_made_again": (),
    # Benchmarks, the tuner and the device audit: one of each kind of run.
    "tests/bench/test_bench.py::test_tune_searches_schedule_v_m_and_data_parallel_within_a_third_and_writes_a_train_config": (),
    "tests/bench/test_bench.py::test_a_chosen_pipeline_with_two_stages_per_rank_or_data_parallel_trains_from_tune_toml": ("ddp",),
    "tests/test_device_audit.py::test_collective_tensors_are_placed": ("check",),
    "tests/results/test_gpu_compare.py::test_a_tiny_model_of_the_kind_trains_on_the_text_by_the_runs_command_line": (),
    "tests/results/test_tune_robustness.py::test_runs_in_a_row_write_one_file_with_the_command_that_made_it": (),
    # The pipeline's runtime: structures, chains, the ResNet's batch norm, precision, compile.
    "tests/pipeline/test_structures_engine.py::test_process_runtime_carries_structures": ("dict-*", "llama-*"),
    "tests/pipeline/test_chain_structures.py::test_brigade_train_and_the_trainer_equal_one_device": (),
    "tests/pipeline/test_equivalence.py::test_resnet50_batchnorm_per_microbatch": (),
    "tests/pipeline/test_equivalence.py::test_process_runtime_matches_single_device": ("gpt-2-*", "toy-*"),
    "tests/pipeline/transport/test_p2p.py::test_p2p_policies_deliver_shapes_and_values_on_gloo": ("grouped",),
    "tests/train/test_precision.py::test_fp16_stages_and_shards_skip_the_same_steps_and_keep_the_same_scale": ("shard2",),
    "tests/parallel/test_compiled.py::test_blocks_alike_share_one_graph_and_a_watched_forward_runs_eager_without_spoiling_it": (),
    "tests/parallel/test_compiled.py::test_a_compiled_blocks_weight_gradients_come_with_its_input_gradient": (),
    "tests/parallel/test_compiled.py::test_selective_blocks_stay_eager_and_full_recompute_runs_the_compiled_forward_again": (),
    "tests/parallel/test_sequence.py::test_each_part_draws_its_own_dropout_masks_and_recompute_replays_them": (),
    "tests/train/test_experts.py::test_a_run_writes_the_figures_and_draws_them": (),
    # Moved when LoRA, the chunked loss and documents joined the default tier (10-20 s each, the
    # default's slowest of their kind): each proof's layout or path is still the default's in
    # another test (ep and bf16 × cp through the README's commands and test_precision, a damaged
    # snapshot through test_faults, the collective audit through its check, bench through its
    # trained tune.toml, the planner through its formula's cheaper tests, check through test_run).
    f"{TRAINER}::test_sharded_gradient_accumulation_reduces_once_per_step": (),
    "tests/check/test_hf.py::test_every_schedule_equals_transformers": (),
    "tests/bench/test_bench.py::test_bench_writes_json_plots_and_a_table": (),
    f"{PLANNER}/test_budget.py::test_what_does_not_fit_is_left_out_and_nothing_fitting_is_one_line": (),
    f"{PLANNER}/test_formula.py::test_selective_keeps_the_input_and_the_outputs_of_the_matmuls_and_attention": (),
    "tests/pipeline/transport/test_nccl.py::test_p2p_issues_exactly_the_groups_the_proof_runs": (),
    "tests/train/test_metrics.py::test_brigade_train_tensorboard_writes_every_metric_at_its_step": (),
    "tests/test_cli.py::test_check_gpt_two_processes_json": (),
    # The suite's own machinery (the tiers' own rules: a collection of the whole suite, 15-25 s),
    # and refusals proven in process elsewhere.
    "tests/test_tiers.py": (),
    "tests/test_watchdog.py::test_pytest_timeout_alone_cannot_end_a_test_blocked_in_c": (),
    "tests/test_gpu_tier.py::test_the_gpu_tier_collects_every_gpu_test_and_each_skips_without_a_gpu": (),
    "tests/test_bad_input.py::test_too_many_processes_warns": (),
    "tests/test_doctor_group.py::test_the_doctor_fails_when_data_is_not_delivered": ("none-*", "send-zeros-*"),
}


def clean(nodeid: str) -> str:
    """A node id without the `@group` suffix that xdist gives the cases of an xdist_group."""
    return re.sub(r"@[\w.-]+\]?$", "", nodeid)


def split_id(nodeid: str) -> tuple[str, str, str]:
    """A node id as (file, file::function, case id), the case id empty where the test has no
    parameters."""
    name, _, case = clean(nodeid).partition("[")
    return name.split("::")[0], name, case.removesuffix("]")


def entry(nodeid: str) -> str | None:
    """The key of FULL that names this case's test, if any (its function before its file)."""
    path, name, _ = split_id(nodeid)
    return name if name in FULL else path if path in FULL else None


def in_full(nodeid: str) -> bool:
    """Whether FULL leaves this case to the full tier: its test is named and the case is not one
    of the representatives kept beside it."""
    key = entry(nodeid)
    if key is None:
        return False
    case = split_id(nodeid)[2]
    return not any(fnmatch.fnmatchcase(case, pattern) for pattern in FULL[key])


def tier(item: pytest.Item) -> str:
    """The tier a collected case runs in: the first of its markers among cuda, slow and full,
    else the default."""
    return next((name for name in ("cuda", "slow", "full") if item.get_closest_marker(name)), "default")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--tiers-report", default=None, metavar="FILE",
                     help="write each collected case's tier (default, full, slow, cuda) as JSON")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "full: the rest of a grid whose representatives are in the default "
                            "tier (tests/tiers.py); run by `python -m pytest -m full`, in CI after the default")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:  # a slow or cuda case of a grid named in FULL stays in its own tier
        if in_full(item.nodeid) and not any(item.get_closest_marker(name) for name in ("slow", "cuda")):
            item.add_marker(pytest.mark.full)
    report = config.getoption("tiers_report")
    if report and not hasattr(config, "workerinput"):  # written where collection ends: run it with -n 0
        Path(report).write_text(json.dumps({clean(item.nodeid): tier(item) for item in items}, indent=0))
