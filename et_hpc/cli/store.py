"""The ``et-hpc store`` (summary, compact) and ``et-hpc export`` (atropos, skyrl, atif) subcommands."""

from __future__ import annotations

import argparse
import sys
import textwrap

from et_hpc import util
from et_hpc.cli.common import add_command, add_subcommands
from et_hpc.util import format_table


def _wrap(text: str) -> str:
    return textwrap.fill(text, width=88)


def register(subparsers: argparse._SubParsersAction) -> None:
    store = add_command(
        subparsers,
        "store",
        help="inspect and compact a run's parquet store",
        description=_wrap(
            "A run's episodes live in RUN_DIR as part-*.parquet shards, one per finished "
            "episode or small batch. 'summary' counts them; 'compact' merges small shards."
        ),
        epilog="examples:\n  et-hpc store summary et-hpc-runs/nightly-0412\n  et-hpc store compact et-hpc-runs/nightly-0412",
    )
    ssub = add_subcommands(store, "store_command")

    p = add_command(
        ssub,
        "summary",
        help="episodes per status, pass rate and mean reward of a run",
        description=_wrap(
            "Count a run's episodes after dedupe (one record per task and sample; an ok "
            "record beats an error record). pass rate = ok episodes with reward 1 / ok episodes."
        ),
        epilog="example:\n  et-hpc store summary et-hpc-runs/my-run --json | jq .pass_rate",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run's folder (inside the store, e.g. et-hpc-runs/my-run)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(func=_summary)

    p = add_command(
        ssub,
        "compact",
        help="merge small shards into big ones (safe while the run is read or written)",
        description=_wrap(
            "Merge small part-*.parquet shards into shards of about --target-rows rows. "
            "Each merged shard is written before its inputs are deleted, so readers never miss an "
            "episode; shards written meanwhile are left for the next compaction. Leftover .tmp-* files "
            "older than an hour (killed writers) are removed. Reading 100k episodes from thousands "
            "of one-episode shards is slow; after compaction it takes about a second."
        ),
        epilog="example:\n  et-hpc store compact et-hpc-runs/my-run --target-rows 16384",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run's folder")
    p.add_argument("--target-rows", type=int, default=None, help="rows per merged shard (default 16384)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_compact)

    exp = add_command(
        subparsers,
        "export",
        help="write a run's ok episodes for a trainer (Atropos JSONL, SkyRL/verl parquet)",
        description=_wrap(
            "Export the ok episodes of a run (deduped) in a trainer's format, group by "
            "group (what was sampled together: its group_id). A group with an episode that "
            "ended in an error, or without exact token ids, is left out whole by default. The counts are printed."
        ),
        epilog="examples:\n  et-hpc export atropos et-hpc-runs/my-run -o groups.jsonl\n"
        "  et-hpc export skyrl et-hpc-runs/my-run -o episodes.parquet",
    )
    esub = add_subcommands(exp, "export_format", "FORMAT")

    p = add_command(
        esub,
        "atropos",
        help="Atropos ScoredDataGroup JSONL, one line per sampled group",
        description=_wrap(
            "One ScoredDataGroup per line: the ok samples of one group (its group_id) "
            "with tokens, masks (-100 on prompt and tool-output "
            "positions), scores, inference_logprobs and messages. A group with a member without "
            "exact token ids (absent or drifted) is left out and counted. A group with an "
            "episode that ended in an error is left out whole (--on-error keep-ok keeps its ok "
            "episodes). Groups whose scores are all equal are dropped (as Atropos does) unless "
            "--keep-equal-scores. The counts are printed."
        ),
        epilog="examples:\n  et-hpc export atropos et-hpc-runs/my-run -o data/endless.jsonl\n"
        "  et-hpc export atropos et-hpc-runs/my-run -o all.jsonl --keep-equal-scores --on-error keep-ok",
    )
    _export_args(p, "the JSONL file to write")
    p.add_argument("--keep-equal-scores", action="store_true", help="also write groups whose scores are all equal")
    p.add_argument("--json", action="store_true", help="print what was written as JSON")
    p.set_defaults(func=_export_atropos)

    p = add_command(
        esub,
        "skyrl",
        help="SkyRL/verl-style parquet, one row per ok episode",
        description=_wrap(
            "One row per ok episode of the kept groups. SkyRL GeneratorOutput columns: "
            "prompt_token_ids, response_ids, loss_masks (1 on completion tokens, 0 on tool output), "
            "rollout_logprobs, rewards, trajectory_ids {instance_id = the group_id, repetition_id}, stop_reasons "
            "(a group with a member without exact token ids is left out and counted); and the dataset columns data_source "
            "('endless'), prompt and messages (lists of {role, content}), env_class, ability, reward, "
            "reward_spec, reward_model, extra_info (task_id, sample, turns, ...). A group with an "
            "episode that ended in an error is left out whole unless --on-error keep-ok."
        ),
        epilog="examples:\n  et-hpc export skyrl et-hpc-runs/my-run -o episodes.parquet\n"
        "  et-hpc export skyrl et-hpc-runs/my-run -o grpo.parquet --drop-zero-variance",
    )
    _export_args(p, "the parquet file to write")
    p.add_argument("--drop-zero-variance", action="store_true", help="leave out groups whose scores are all equal")
    p.add_argument("--json", action="store_true", help="print what was written as JSON")
    p.set_defaults(func=_export_skyrl)

    p = add_command(
        esub,
        "atif",
        help="ATIF v1.8 trajectories (Harbor's format), one JSON document per episode",
        description=_wrap(
            "One ATIF v1.8 document per episode (deduped; error episodes too, with their "
            "status, unless --ok-only): steps with the model's text, reasoning and tool calls, the "
            "commands' output as observations, per-step token ids and logprobs when recorded, and the "
            "reward, tests and timings in final_metrics. Files: OUT_DIR/<task>.<sample>.json and "
            "OUT_DIR/index.jsonl."
        ),
        epilog="example:\n  et-hpc export atif et-hpc-runs/my-run -o trajectories/",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run's folder")
    p.add_argument("-o", "--output", required=True, metavar="OUT_DIR", help="the folder to write the documents into")
    p.add_argument("--ok-only", action="store_true", help="only episodes with status ok")
    p.set_defaults(func=_export_atif)


def _export_args(p: argparse.ArgumentParser, output_help: str) -> None:
    """RUN_DIR, -o and --on-error: what every export format takes."""
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run's folder")
    p.add_argument("-o", "--output", required=True, help=output_help)
    p.add_argument(
        "--on-error",
        choices=["mask", "keep-ok"],
        default="mask",
        help="a group with an episode that ended in an error: leave it out whole (mask, the default) or keep its ok episodes (keep-ok)",
    )
    p.add_argument(
        "--exclude-cancelled",
        action="store_true",
        help="leave out the Atropos environment's groups that atropos cancelled (stored, never sent to its trainer)",
    )


def _summary(args: argparse.Namespace) -> int:
    from et_hpc.runs.store import open_run

    s = open_run(args.run_dir).summary()
    if args.json:
        print(s.model_dump_json(indent=2))
        return 0
    rows = [[k, v] for k, v in s.by_status.items() if v or k == "ok"]
    print(f"run {s.run_name}: {s.units} episodes ({s.rows} records in {s.shards} shards)")
    if s.planned_units is not None:
        print(f"planned: {s.planned_units}")
    print(format_table(["status", "episodes"], rows))
    print(
        f"pass rate {util.pct(s.pass_rate)}  mean reward {util.num(s.mean_reward, '{:.3f}')}  "
        f"mean test fraction {util.num(s.mean_test_fraction, '{:.3f}')}"
    )
    if s.evaluation is not None and s.evaluation.per_task:
        from et_hpc.runs.passk import table

        print(format_table(*table(s.evaluation)))
        print("pass@1: solved / ok with a 95% Wilson interval; pass@k: the unbiased estimator, where a task has k samples")
    if s.groups is not None:
        g = s.groups
        print(
            f"groups {g.total}: {g.complete} complete, {g.masked} masked (an episode ended in an error), "
            f"{g.zero_variance} zero-variance (complete, all scores equal), {g.incomplete} incomplete (members missing), "
            f"{g.without_tokens} complete without exact token ids, {g.cancelled} cancelled by atropos; "
            f"{g.trainable} trainable; reward rule {'/'.join(g.reward_rules) or 'unrecorded'}"
        )
    return 0


def _compact(args: argparse.Namespace) -> int:
    from et_hpc.errors import UserError
    from et_hpc.runs.store import DEFAULT_TARGET_ROWS, open_run

    target = args.target_rows or DEFAULT_TARGET_ROWS
    if target < 1:
        raise UserError("--target-rows must be at least 1")
    r = open_run(args.run_dir).compact(target_rows=target, progress=True)
    if args.json:
        print(r.model_dump_json(indent=2))
    else:
        print(
            f"merged {r.inputs} shards into {r.outputs} ({r.rows} rows); {r.shards_after} shards now; "
            f"removed {r.removed_tmp} stale temp files"
        )
    return 0


def _report_export(res, args: argparse.Namespace) -> int:
    if args.json:
        print(res.model_dump_json(indent=2))
    else:
        print(res.line(), file=sys.stdout)
    return 0


def _export_atropos(args: argparse.Namespace) -> int:
    from et_hpc.runs.export import export_atropos
    from et_hpc.runs.store import open_run

    res = export_atropos(
        open_run(args.run_dir),
        args.output,
        on_error=args.on_error,
        drop_zero_variance=not args.keep_equal_scores,
        progress=True,
        exclude_cancelled=args.exclude_cancelled,
    )
    return _report_export(res, args)


def _export_skyrl(args: argparse.Namespace) -> int:
    from et_hpc.runs.export import export_skyrl
    from et_hpc.runs.store import open_run

    res = export_skyrl(
        open_run(args.run_dir),
        args.output,
        on_error=args.on_error,
        drop_zero_variance=args.drop_zero_variance,
        progress=True,
        exclude_cancelled=args.exclude_cancelled,
    )
    return _report_export(res, args)


def _export_atif(args: argparse.Namespace) -> int:
    from et_hpc.runs.atif import export_atif
    from et_hpc.runs.store import open_run

    print(export_atif(open_run(args.run_dir), args.output, ok_only=args.ok_only).line())
    return 0
