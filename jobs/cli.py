"""The `ditfleet` command.

    ditfleet validate job.yaml             spec and every input row; no cluster, no GPU
    ditfleet plan job.yaml [--json]        rows, shards, buckets, images that a run would make
    ditfleet run job.yaml [--address A]    run or resume the job (local Ray, or a cluster)
    ditfleet submit job.yaml --address http://HEAD:8265 --slot SLOT [--wait] [--working-dir DIR]
                                           submit `ditfleet run job.yaml` to a cluster once per slot
    ditfleet status OUTPUT [--json]        committed shards, rows ok/failed, what is left
    ditfleet verify OUTPUT [--partial] [--clean] [--json] [--ray [--address A]]
                                           check an output end to end from its manifests
    ditfleet preview OUTPUT --out s.png    contact sheet of generated images with their prompts
    ditfleet inspect MODEL [--bucket WxH]  a model's components and memory plan (configs and headers only)

Exit codes: 0 done; 1 the job ran but rows or shards failed, or it stopped on a store error
after retries (committed shards are kept: run it again to resume; for status, the output is
incomplete; for verify, a problem was found or the output is incomplete); 2 bad job file, bad
input, a location or store that cannot be used, an output of another job, or bad usage: nothing
written.

`run` connects to an existing cluster when --address or RAY_ADDRESS is given (that is how it
runs as the entrypoint of `ray job submit --working-dir . -- ditfleet run job.yaml`), else it
starts a local Ray on 127.0.0.1 without a dashboard. An address where nothing answers for
--connect-timeout seconds (30) is exit 2, "no Ray cluster at ADDRESS", before anything is written.
`ditfleet` alone prints the commands; `ditfleet COMMAND --help` says more about each.
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
import typing
from collections.abc import Sequence
from pathlib import Path

from ditfleet.driver.dispatch import DispatchError
from ditfleet.driver.input.prompts import glob_start
from ditfleet.driver.input.row_errors import InputError
from ditfleet.driver.locations import LocationError
from ditfleet.driver.memory_plan import GPU_SIZES_GB, MemoryPlanError, MemoryRequest
from ditfleet.driver.run_job import OutputMismatch, check_job_input, validate_job_input
from ditfleet.jobs.exit_codes import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK, UsageError, usage_errors
from ditfleet.jobs.output_commands import add_output_commands, add_s3_options, store_config
from ditfleet.jobs.plan_command import cmd_plan
from ditfleet.jobs.prompt_words import tiny_words_warning
from ditfleet.jobs.ray_auth import CONNECT_DEADLINE_S, ClusterAuthError, NoRayCluster
from ditfleet.jobs.run import check_memory, checked_spec, interrupted_note, run, say
from ditfleet.jobs.spec import JobSpec, SpecError, load_spec
from ditfleet.jobs.spec.reference import REFERENCE_PATH
from ditfleet.jobs.submit import SubmitError, submit_slot
from ditfleet.model.settings import MAX_SEQUENCE_LENGTH, Quantization
from ditfleet.workers.storage import StoreConfigError, StoreError
from ditfleet.workers.storage.input_files import is_s3


def cmd_validate(args: argparse.Namespace) -> int:
    spec = checked_spec(args.job)  # files and schemas, as every command checks them first
    report = validate_job_input(spec.to_driver_config())
    if not report.ok:
        raise InputError(report.errors, report.total)
    memory = check_memory(spec, args.job)
    print(f"{args.job}: ok: {report.rows} rows in {len(report.files)} file(s) under {spec.input_uri()}")
    if (words := tiny_words_warning(spec)) is not None:
        print(f"warning: {words}")
    if memory is not None:
        print(f"memory: fits {spec.workers.gpu_memory_gb:g} GB; worst: {memory.worst().describe()}")
    return EXIT_OK


def _shard_list(text: str) -> tuple[int, ...]:
    try:
        shards = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give shard numbers separated by commas, e.g. 3,7"
        ) from None
    if not shards or min(shards) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give shard numbers >= 0 separated by commas, e.g. 3,7")
    return shards


def cmd_run(args: argparse.Namespace) -> int:
    summary = run(
        args.job,
        address=args.address,
        redo_shards=args.redo_shards or (),
        connect_deadline_s=args.connect_timeout,
        verbose=args.verbose,
    )
    if summary.shards.get("committed"):  # how to get the job's report page
        output = shlex.quote(summary.output)
        print(f"report: ditfleet report {output}  (one HTML page, report.html; open it in a browser)")
    return summary.exit_code


def cmd_submit(args: argparse.Namespace) -> int:
    spec = load_spec(args.job)  # a bad job file fails here, not on the cluster
    _check_input_for_submit(spec)
    if not spec.name:
        raise UsageError(
            f"{args.job}: the job has no `name`; submit derives the Ray submission id from the name "
            "and the slot, so give the job a name"
        )
    if not args.slot.strip():
        raise UsageError('--slot must not be empty (e.g. the scheduled date: --slot "$(date -u +%F)")')
    return submit_slot(
        args.job,
        spec.name,
        args.address,
        args.slot,
        wait=args.wait,
        working_dir=args.working_dir,
        resubmit_failed=args.resubmit_failed,
    )


def _check_input_for_submit(spec: JobSpec) -> None:
    """The input checked as `run` would, when this machine can read it: s3://, or a local path
    that is here (a path only the cluster's nodes mount is checked there, by `ditfleet run`)."""
    uri = spec.input_uri()
    parts = Path(uri).parts
    first_glob = glob_start(parts)
    here = Path(*parts[:first_glob]) if first_glob else Path(uri)
    if is_s3(uri) or here.exists():
        check_job_input(spec.to_driver_config())
    else:
        say(f"input not checked here: {uri} is not on this machine (the cluster's `ditfleet run` checks it)")


def cmd_calibrate(args: argparse.Namespace) -> int:
    from ditfleet.jobs.calibrate import calibrate, format_calibration

    spec = checked_spec(args.job)
    with usage_errors(ValueError):
        result = calibrate(
            spec,
            n=args.n,
            presets=args.preset or ("safe", "fast"),
            steps=args.steps,
            buckets=args.bucket,
            log=(lambda *_: None) if args.json else print,
        )
    print(json.dumps(result, indent=2) if args.json else format_calibration(result))
    return EXIT_OK


def cmd_inspect(args: argparse.Namespace) -> int:
    from ditfleet.jobs.inspect_model import format_inspection, inspect_model

    request = MemoryRequest(
        args.model,
        tuple(args.bucket or ()),
        args.batch,
        dtype=args.dtype,
        max_sequence_length=args.max_sequence_length,
        s3=store_config(args),
        quantization=args.quantization,
    )
    info = inspect_model(request, args.gpu_gb)
    print(json.dumps(info, indent=2) if args.json else format_inspection(info))
    return EXIT_OK


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ditfleet")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "(not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ditfleet",
        description="Generate image datasets on a Ray cluster. `ditfleet COMMAND --help` says more "
        f"about each; every key of a job file: {REFERENCE_PATH}.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    # Not required: `ditfleet` alone prints these commands (main), not only an error.
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_job_commands(sub)
    _add_inspect(sub)
    add_output_commands(sub)
    return parser


def _add_job_commands(sub: argparse._SubParsersAction) -> None:
    """validate, plan, run, submit, calibrate: commands that take a job file."""
    p = sub.add_parser(
        "validate",
        help="check the job file and every input row (no cluster, no GPU)",
        description="Check the job file and every input row (no cluster, no GPU). Every key a job "
        f"file may hold, with its type, default and bounds: {REFERENCE_PATH}.",
    )
    p.add_argument("job", help=f"job file (YAML or JSON; its keys: {REFERENCE_PATH})")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("plan", help="what a run would do: rows, shards, buckets, images")
    p.add_argument("job", help=f"job file (YAML or JSON; its keys: {REFERENCE_PATH})")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument(
        "--selftest",
        metavar="SELFTEST_JSONL",
        help="a node self-test's selftest.jsonl: estimate GPU-seconds and dollars per image from its measured lines",
    )
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("run", help="run or resume the job")
    p.add_argument("job", help=f"job file (YAML or JSON; its keys: {REFERENCE_PATH})")
    p.add_argument(
        "--address",
        help="Ray cluster to use: HOST:PORT of its head (GCS, 6379 by default), ray://HOST:10001, or auto "
        "(default: RAY_ADDRESS, else a local Ray)",
    )
    p.add_argument(
        "--connect-timeout",
        type=float,
        default=CONNECT_DEADLINE_S,
        metavar="S",
        help=f"give up, exit 2, when nothing answers at the address for S seconds (default {CONNECT_DEADLINE_S:g})",
    )
    p.add_argument(
        "--verbose", action="store_true", help="the summary also prints the DiT's attention counters"
    )
    p.add_argument(
        "--redo-shards",
        type=_shard_list,
        metavar="3,7",
        help="run these committed shards again under new attempts; each commits a new manifest "
        "generation that supersedes its old one, the other shards are left as they are",
    )
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("submit", help="submit the job to a Ray cluster, once per schedule slot")
    p.add_argument("job", help="job file (YAML or JSON); it must have a `name`")
    p.add_argument("--address", help="the cluster's job server, http://HEAD:8265 (default: RAY_ADDRESS)")
    p.add_argument(
        "--slot",
        required=True,
        help="the schedule slot, e.g. the date; one job runs per job name and slot",
    )
    p.add_argument("--wait", action="store_true", help="follow the logs; exit with the job's status")
    p.add_argument(
        "--working-dir",
        help="directory uploaded with the job (the job file is named relative to it when inside it)",
    )
    p.add_argument(
        "--resubmit-failed",
        action="store_true",
        help="if the slot's job already ended FAILED or STOPPED, run it again (it resumes its output)",
    )
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser(
        "calibrate",
        help="the step-cache presets' speed-up and quality cost on this model: exact vs each preset, same prompts and seeds",
    )
    p.add_argument("job", help="job file (YAML or JSON): its model, steps, CFG, batch size and buckets")
    p.add_argument("--n", type=int, default=64, help="prompts per bucket (default 64)")
    p.add_argument(
        "--preset",
        action="append",
        help="preset to measure, or settings as in a job file, e.g. '{preset: fast, threshold: 0.4}' "
        "(repeatable; default safe and fast)",
    )
    p.add_argument("--steps", type=int, help="denoising steps (default: the job's)")
    p.add_argument("--bucket", action="append", help="bucket WxH (repeatable; default: the job's buckets)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_calibrate)


def _add_inspect(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "inspect", help="a model's components and memory plan (reads configs and headers only)"
    )
    p.add_argument(
        "model", help="a diffusers-layout model folder, s3://bucket/prefix (configs only), or 'tiny'"
    )
    p.add_argument("--bucket", action="append", help="image size WxH (repeatable; default: the largest)")
    p.add_argument("--batch", type=int, default=1, help="images per batch (default 1)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument(
        "--quantization",
        choices=typing.get_args(Quantization),
        default="none",
        help="the DiT's weights, as model.quantization (default none; fp8 halves them)",
    )
    p.add_argument(
        "--gpu-gb",
        type=float,
        nargs="+",
        default=list(GPU_SIZES_GB),
        help=f"GPU sizes in GB (default {' '.join(f'{gb:g}' for gb in GPU_SIZES_GB)})",
    )
    p.add_argument(
        "--max-sequence-length",
        type=int,
        default=MAX_SEQUENCE_LENGTH,
        help=f"longest prompt in tokens (default {MAX_SEQUENCE_LENGTH})",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    add_s3_options(p, "models")
    p.set_defaults(func=cmd_inspect)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `ditfleet` console script; returns the exit code."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_OK
    try:
        return args.func(args)
    except (
        SpecError,
        InputError,
        OutputMismatch,
        UsageError,
        LocationError,
        MemoryPlanError,
        ClusterAuthError,
        NoRayCluster,
    ) as e:
        say(str(e))
        return EXIT_BAD_INPUT
    except StoreConfigError as e:  # found before any work: nothing written
        say(f"{type(e).__name__}: {e}")
        return EXIT_BAD_INPUT
    except (StoreError, OSError) as e:
        # A store that failed after its retries, mid-job: the job failed, its input was fine.
        if args.command == "run":
            say(
                f"the job failed on a store error, after retries ({type(e).__name__}: {e}). Committed "
                "shards are kept: run the same command again to resume"
            )
        else:
            say(f"{type(e).__name__}: {e}")
        return EXIT_FAILED
    except ValueError as e:
        # A damaged file in the output, a value that cannot be used: say what and where.
        say(f"{type(e).__name__}: {e}")
        return EXIT_BAD_INPUT
    except (DispatchError, SubmitError) as e:
        say(str(e))
        return EXIT_FAILED
    except KeyboardInterrupt:
        say(interrupted_note(args.job) if args.command == "run" else "interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
