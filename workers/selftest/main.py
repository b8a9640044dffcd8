"""The self-test's command line: options, logging into the output folder, then the stages."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# The whole run's budget on a GPU node (7 minutes), compiles included.
BUDGET_S = 420.0
# The stages' estimates add up to at most this much less than the budget: room for the children's
# start-up and for a GPU slower than the estimates assume (tests/unit/workers/test_selftest.py).
ESTIMATE_MARGIN = 0.10


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m ditfleet.workers.selftest",
        description="Correctness and speed of the GPU path, one JSON line per measurement.",
    )
    p.add_argument(
        "--out",
        required=True,
        help="folder for selftest.jsonl and selftest.log (and cfg_table.json with --extra cfg_modes)",
    )
    p.add_argument(
        "--scratch",
        default=None,
        help="folder for the weight shards, the worker's shard and the Inductor cache "
        "(default: a new temporary folder); removed at the end unless --keep-scratch",
    )
    p.add_argument(
        "--keep-scratch", action="store_true", help="keep the scratch folder (a second run starts warm)"
    )
    p.add_argument(
        "--in-process",
        action="store_true",
        help="run the compile-heavy stages in this process too (their deadline cannot stop a compile)",
    )
    p.add_argument("--child-stage", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-offset-s", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--child-facts", default="", help=argparse.SUPPRESS)
    p.add_argument(
        "--tiny", action="store_true", help="toy widths on the CPU: the smoke run of the test suite"
    )
    p.add_argument("--device", default="auto", help="auto (cuda when present), cuda, cuda:N or cpu")
    p.add_argument(
        "--budget-s", type=float, default=None, help=f"whole-run budget (default {BUDGET_S:.0f}; tiny: 120)"
    )
    p.add_argument("--only", default="", help="comma-separated stage names to run (default: all)")
    p.add_argument("--skip", default="", help="comma-separated stage names to leave out")
    p.add_argument(
        "--extra", default="", help="comma-separated optional stages to run too (beyond the budget's plan)"
    )
    p.add_argument("--list", action="store_true", help="list the stages with their estimates and exit")
    p.add_argument(
        "--sizes", type=int, nargs="+", default=[1328, 1024], help="square sizes, main bucket first"
    )
    p.add_argument("--layers", type=int, default=60, help="DiT depth of the speed lines (published: 60)")
    p.add_argument("--slice-blocks", type=int, default=2, help="blocks of the slice loaded from disk (1-2)")
    p.add_argument("--text-len", type=int, default=128, help="prompt tokens of the speed lines")
    p.add_argument("--repeat", type=int, default=3, help="timed calls per measurement (median)")
    p.add_argument("--compile-mode", default=None, help="Inductor mode of the DiT (default: the worker's)")
    p.add_argument("--compile-backend", default=None, help="default: inductor (tiny: eager, Dynamo only)")
    p.add_argument("--worker-steps", type=int, default=6, help="steps per image in the batch-generator line")
    p.add_argument("--worker-images", type=int, default=2)
    p.add_argument("--worker-batch", type=int, default=2)
    p.add_argument("--limit-scale", type=float, default=1.0, help="tiny: scale the stage deadlines")
    return p


def _logging(out: Path) -> None:
    handler = logging.FileHandler(out / "selftest.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    logging.captureWarnings(True)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from ditfleet.workers.selftest import stages  # noqa: F401 - registers the stages
    from ditfleet.workers.selftest.child_process import load_facts
    from ditfleet.workers.selftest.runner import STAGES, Context, run_child, run_stages

    if args.list:
        for s in STAGES:
            where = (" child" if s.isolated else "") + (", optional" if s.optional else "")
            print(f"{s.name:28s} ~{s.estimate_s:4.0f} s (limit {s.limit_s:4.0f} s{where})  {s.doc}")
        return 0
    child = args.child_stage is not None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not child:
        (out / "selftest.jsonl").write_text("")
    scratch = Path(args.scratch) if args.scratch else Path(tempfile.mkdtemp(prefix="ditfleet-selftest-"))
    scratch.mkdir(parents=True, exist_ok=True)
    _logging(out)
    # Inductor's caches in the scratch folder unless the node sets them (the children of the
    # compile-heavy stages inherit it: what they compile, this process loads).
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(scratch / "inductor-cache"))
    import torch

    device = _device(args.device, args.tiny)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device is visible", file=sys.stderr)
        return 2
    if args.tiny:
        _shrink_to_tiny(args)
    ctx = Context(
        args=args,
        out=out,
        device=device,
        dtype=torch.bfloat16,
        tiny=args.tiny,
        started=time.perf_counter() - args.child_offset_s,
        budget_s=args.budget_s or (120.0 if args.tiny else BUDGET_S),
        scratch=scratch,
        keep_scratch=args.keep_scratch,
        # A child command needs this process's own command line: not when called with other argv.
        child_command=None
        if args.in_process or child or (argv is not None and list(argv) != sys.argv[1:])
        else child_command(scratch),
        child=child,
    )
    torch.manual_seed(0)
    if child:
        ctx.state.update(load_facts(args.child_facts))
        return run_child(ctx, args.child_stage)
    try:
        summary = run_stages(ctx, _names(args.only) or None, _names(args.skip), _names(args.extra))
    finally:
        ctx.remove_scratch()
    return 0 if summary["status"] == "pass" else 1


def _device(option: str, tiny: bool) -> torch.device:
    """`--device`: auto is cuda when present, except on a `--tiny` run (the CPU)."""
    import torch

    if option == "auto":
        return torch.device("cuda" if torch.cuda.is_available() and not tiny else "cpu")
    return torch.device(option)


def _shrink_to_tiny(args: argparse.Namespace) -> None:
    """A `--tiny` run: one timed call and toy depth, text and step counts."""
    args.repeat = 1
    args.layers = min(args.layers, 4)
    args.text_len = min(args.text_len, 16)
    args.worker_steps = min(args.worker_steps, 2)


def _names(option: str) -> set[str]:
    return {s for s in option.split(",") if s}


def child_command(scratch: Path) -> list[str]:
    """This process's own command line (interpreter options, `-m` or `-c` included) with the
    scratch folder fixed, for the child of an isolated stage; it appends its own options."""
    return [sys.executable, *sys.orig_argv[1:], "--scratch", str(scratch), "--keep-scratch"]


def run_and_exit(argv: Sequence[str] | None = None) -> None:
    """`main`, then exit at once with its code once every line is flushed. The verdict is written
    by then; a native library's teardown at interpreter exit (seen once on a CI machine: SIGABRT
    after the summary line of a passing run, not reproduced) must not turn it into a failure."""
    code = main(argv)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
