"""`ditfleet status | verify | compact | score | preview | report OUTPUT`: the commands that read an
output a job wrote, each a cmd_NAME and the _add_NAME that declares its arguments; and what every
command shares: the S3 options.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable, Iterator

from ditfleet.driver.output.compact import ROW_GROUP_ROWS
from ditfleet.driver.output.status import output_status
from ditfleet.jobs.exit_codes import EXIT_FAILED, EXIT_OK, UsageError, usage_errors
from ditfleet.workers.output.layout import MANIFESTS_PREFIX
from ditfleet.workers.storage import ObjectStore, S3Config, open_store
from ditfleet.workers.storage.input_files import is_s3


def store_config(args: argparse.Namespace) -> S3Config:
    return S3Config(endpoint_url=args.endpoint_url, region=args.region)


def add_s3_options(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--endpoint-url", help=f"S3-compatible endpoint for s3:// {what}")
    p.add_argument("--region", help="S3 region")


def _open_output(args: argparse.Namespace) -> ObjectStore:
    """The output an output command reads; a local path that is a file is a usage error."""
    path = args.output.removeprefix("file://")
    if "://" not in path and os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(
            f"{args.output} is a file, not an output folder: give the folder a job wrote (its output.uri)"
        )
    return open_store(args.output, store_config(args))


@contextlib.contextmanager
def _ray_if_asked(args: argparse.Namespace) -> Iterator[None]:
    """With --ray: connected to the cluster of --address (RAY_ADDRESS, else a local Ray) while
    the block runs, and disconnected after unless this process was connected already."""
    if args.address and not args.ray:
        raise UsageError(f"{args.command} --address is the cluster of --ray: give --ray too")
    if not args.ray:
        yield
        return
    from ditfleet.jobs.run import connect_ray

    owned = connect_ray(args.address)
    try:
        yield
    finally:
        if owned:
            import ray

            ray.shutdown()


def _add_ray_options(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--ray", action="store_true", help=what)
    p.add_argument(
        "--address",
        help="with --ray: the cluster to connect to (default RAY_ADDRESS, else a local Ray on 127.0.0.1)",
    )


def _output_parser(
    sub: argparse._SubParsersAction, name: str, command: Callable[[argparse.Namespace], int], help: str
) -> argparse.ArgumentParser:
    """The parser of an output command: the output it reads and that output's S3 options."""
    p = sub.add_parser(name, help=help)
    p.add_argument("output", help="output directory or s3://bucket/prefix")
    add_s3_options(p, "outputs")
    p.set_defaults(func=command)
    return p


def cmd_status(args: argparse.Namespace) -> int:
    status = output_status(_open_output(args))
    if status.job is None and not status.committed:
        raise UsageError(f"{args.output}: no _job.json and no manifests: not a ditfleet output (yet)")
    d = status.to_dict()
    print(json.dumps(d, indent=2) if args.json else status.format_text())
    return EXIT_OK if d["complete"] and not d["rows"]["failed"] else EXIT_FAILED


def _add_status(sub: argparse._SubParsersAction) -> None:
    p = _output_parser(sub, "status", cmd_status, "what an output holds and what is left")
    p.add_argument("--json", action="store_true", help="print JSON")


def cmd_verify(args: argparse.Namespace) -> int:
    from ditfleet.driver.output.verify import verify_output

    store = _open_output(args)
    with _ray_if_asked(args):
        checks = None
        if args.ray:
            from ditfleet.driver.output.verify_ray import RayChecks

            # The store's own URI: a relative path would be resolved in each task's working directory.
            checks = RayChecks(store.uri(), store_config(args))
        report = verify_output(
            store,
            partial=args.partial,
            clean=args.clean,
            hash_objects=not args.no_hash,
            workers=args.workers,
            shard_checks=checks,
        )
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.format_text())
    return EXIT_OK if report.exit_code == 0 else EXIT_FAILED


def _add_verify(sub: argparse._SubParsersAction) -> None:
    p = _output_parser(
        sub, "verify", cmd_verify, "check an output end to end: every row once, every object's sha256"
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument(
        "--partial",
        action="store_true",
        help="a running or unfinished output: uncommitted shards and no _SUCCESS are not errors",
    )
    p.add_argument(
        "--clean",
        action="store_true",
        help="delete orphans: objects of losing or killed runs of committed shards, "
        "which no manifest names (never anything a manifest names)",
    )
    p.add_argument("--no-hash", action="store_true", help="check presence only; do not read and hash objects")
    p.add_argument(
        "--workers",
        type=int,
        help="threads reading manifests and objects (default: one per CPU core for a local output, 16 for S3)",
    )
    _add_ray_options(
        p,
        "read manifests and hash objects in Ray tasks over the cluster (large outputs); "
        "the whole-output checks and --clean's deletions run here, the report is the same",
    )


def cmd_compact(args: argparse.Namespace) -> int:
    from ditfleet.driver.output.compact import CompactionError, compact_output
    from ditfleet.driver.output.lease import acquire_lease

    store = _open_output(args)
    # A writer like a driver: one at a time, and it stops if another takes the output; it leaves a
    # complete output complete, so its lease does not make _SUCCESS stale.
    with usage_errors(CompactionError), acquire_lease(store, keeps_complete=True, compacts=True) as lease:
        report = compact_output(store, row_group_rows=args.row_group_rows, lease=lease)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.format_text())
    return EXIT_OK


def _add_compact(sub: argparse._SubParsersAction) -> None:
    p = _output_parser(
        sub,
        "compact",
        cmd_compact,
        "after _SUCCESS: the union of the manifests as one Parquet file sorted by id, "
        "compacted/manifests.parquet",
    )
    per_group = f"rows per row group (default {ROW_GROUP_ROWS:,})"
    p.add_argument("--row-group-rows", type=int, default=ROW_GROUP_ROWS, help=per_group)
    p.add_argument("--json", action="store_true", help="print JSON")


def cmd_score(args: argparse.Namespace) -> int:
    from ditfleet.jobs.score import score_output, scorer_source

    store = _open_output(args)
    if next(iter(store.list(MANIFESTS_PREFIX)), None) is None:
        raise UsageError(f"{args.output}: no manifests: not a ditfleet output with committed shards (yet)")
    with _ray_if_asked(args), usage_errors(ValueError):
        s3 = store_config(args)
        source = scorer_source(
            store, args.scorer, model_path=args.model, scorer_model=args.scorer_model, s3=s3
        )
        report = score_output(store, source, workers=args.workers, use_ray=args.ray, ray_s3=s3)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.format_text(store.uri()))
    return EXIT_OK


def _add_score(sub: argparse._SubParsersAction) -> None:
    p = _output_parser(
        sub,
        "score",
        cmd_score,
        "score an output's images into side tables (scores/NAME/), resumable; committed files untouched",
    )
    p.add_argument(
        "--scorer",
        required=True,
        help="sharpness (Laplacian variance), tiny (the tiny model's adherence), vqa (VQAScore from the "
        "model's Qwen2.5-VL) or clip (CLIP score)",
    )
    p.add_argument("--model", default=None, help="vqa: the Qwen-Image model (default: the output's job's)")
    p.add_argument(
        "--scorer-model",
        "--clip-model",
        dest="scorer_model",
        default=None,
        help="clip (a scorer with a model of its own): its model (default: the job's quality.clip_model)",
    )
    p.add_argument("--workers", type=int, default=2, help="threads scoring shards here (default 2)")
    _add_ray_options(p, "score shards in Ray tasks over the cluster")
    p.add_argument("--json", action="store_true", help="print JSON")


def beside_output(store: ObjectStore, name: str) -> str:
    """Where a command writes its file by default: in a local output's folder (readers and verify
    look only at the output's own keys), else, for s3://, in the current directory."""
    root = store.uri()
    return name if is_s3(root) else os.path.join(root, name)


def cmd_preview(args: argparse.Namespace) -> int:
    from ditfleet.jobs.preview import write_preview
    from ditfleet.jobs.source_images import source_reader

    store = _open_output(args)
    out = args.out or beside_output(store, "sheet.png")
    with usage_errors(ValueError):
        sources = source_reader(store, store_config(args))  # an edit job's sources: the same S3 options
        written = write_preview(
            store, out, args.max, args.columns, sort=args.sort, best=args.best, sources=sources
        )
    print(f"wrote {out}: {written.shown} images from {store.uri()}")
    if written.note:
        print(f"note: {written.note}", file=sys.stderr)
    return EXIT_OK


def _add_preview(sub: argparse._SubParsersAction) -> None:
    p = _output_parser(
        sub, "preview", cmd_preview, "contact sheet PNG of generated images with their prompts"
    )
    p.add_argument(
        "--out",
        help="PNG file to write (default: sheet.png in a local OUTPUT, else in the current directory)",
    )
    p.add_argument("--max", type=int, default=24, help="images on the sheet (default 24)")
    p.add_argument("--columns", type=int, help="images per row (default: about square)")
    p.add_argument(
        "--sort",
        metavar="SCORER",
        help="show the images by a score (tiny, sharpness: the manifests' score_NAME, else the tables "
        "of `ditfleet score`), lowest first, each labelled with it",
    )
    p.add_argument("--best", action="store_true", help="with --sort: highest first")


def cmd_report(args: argparse.Namespace) -> int:
    from ditfleet.jobs.report import write_report
    from ditfleet.jobs.source_images import source_reader

    store = _open_output(args)
    html = args.html or beside_output(store, "report.html")
    with usage_errors(ValueError):
        data = write_report(store, html, samples=args.max, sources=source_reader(store, store_config(args)))
    print(f"wrote {html}: report of {store.uri()} ({len(data.rows)} images, {len(data.samples)} samples)")
    for section in data.scores:
        if section.behind:
            print(f"note: {section.behind}", file=sys.stderr)
    return EXIT_OK


def _add_report(sub: argparse._SubParsersAction) -> None:
    p = _output_parser(
        sub,
        "report",
        cmd_report,
        "one self-contained HTML page: summary, rates, start-up costs, failures, samples",
    )
    p.add_argument(
        "--html",
        help="HTML file to write (default: report.html in a local OUTPUT, else in the current directory)",
    )
    p.add_argument("--max", type=int, default=24, help="sample images on the page (default 24)")


def add_output_commands(sub: argparse._SubParsersAction) -> None:
    """status, verify, score, preview, report, compact: commands that read an output."""
    for add in (_add_status, _add_verify, _add_score, _add_preview, _add_report, _add_compact):
        add(sub)
