"""`ditfleet submit`: run a job on a Ray cluster once per schedule slot.

    ditfleet submit job.yaml --address http://HEAD:8265 --slot 2024-06-01 [--wait] [--working-dir DIR]

The Ray submission id is derived from the job's name and the slot ("ditfleet-{name}-{slot}"),
so a scheduler that fires twice for one slot (a cron retry, a Kubernetes Job whose pod is
restarted, two schedulers) starts the job once: the second submit finds the id taken and
attaches to that job instead. The job's entrypoint is `ditfleet run <job file>`.

--wait follows the job's logs and returns its exit status: 0 done, 1 rows or shards failed
(or the job was stopped), 2 bad job file or input. Without --wait, submit returns 0 once the
job is submitted or found running; an existing job that already ended returns its status.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import shlex
import sys
import time
from typing import Any

from ditfleet.jobs.exit_codes import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK
from ditfleet.jobs.ray_auth import refused

MAX_ID_CHARS = 100
_UNSAFE = re.compile(r"[^a-z0-9_-]+")
_POLL_S = 2.0


class SubmitError(RuntimeError):
    """The job server cannot be used (unreachable, refused the job); the message says why."""


def submission_id(name: str, slot: str) -> str:
    """ "ditfleet-{name}-{slot}", lower case, every run of characters other than [a-z0-9_-]
    turned into one "-". When that changed or shortened the text, a hash of the exact name and
    slot is appended, so two different (name, slot) pairs never share an id."""
    raw = f"ditfleet-{name}-{slot}"
    safe = _UNSAFE.sub("-", raw.lower()).strip("-")
    if safe == raw and len(safe) <= MAX_ID_CHARS:
        return safe
    digest = hashlib.sha256(f"{name}\0{slot}".encode()).hexdigest()[:12]
    return f"{safe[: MAX_ID_CHARS - 13].rstrip('-')}-{digest}"


def entrypoint(job_path: str, working_dir: str | None) -> str:
    """`ditfleet run <job>`: the job file relative to the working dir when it is inside it
    (the dir is uploaded with the job), else its absolute path (the head must see that path)."""
    path = os.path.abspath(job_path)
    if working_dir is not None:
        root = os.path.abspath(working_dir)
        if os.path.commonpath([root, path]) == root:
            path = os.path.relpath(path, root)
    return f"ditfleet run {shlex.quote(path)}"


def exit_code(status: str, driver_exit_code: int | None) -> int | None:
    """The exit code of a finished job (None while it runs): the driver's own 0/1/2 where
    it has one, 1 for a job that failed without one (it never started) or was stopped."""
    if status == "SUCCEEDED":
        return EXIT_OK
    if status in ("FAILED", "STOPPED"):
        return driver_exit_code if driver_exit_code in (EXIT_FAILED, EXIT_BAD_INPUT) else EXIT_FAILED
    return None


class SlotSubmitter:
    """Submits, finds and follows the job of one (job name, slot) on one cluster."""

    def __init__(self, address: str | None) -> None:
        from ray.exceptions import AuthenticationError
        from ray.job_submission import JobSubmissionClient

        try:
            self.client = JobSubmissionClient(address)
        except AuthenticationError:
            raise refused(address or os.environ.get("RAY_ADDRESS", "(RAY_ADDRESS)")) from None
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise SubmitError(
                f"cannot reach the Ray job server at {address or '(RAY_ADDRESS)'}: {e}. Check --address "
                "(the dashboard's http://HEAD:8265) and that the cluster is up"
            ) from e

    def info(self, sid: str) -> Any | None:
        """The job's JobDetails, or None when there is no job with this id."""
        try:
            return self.client.get_job_info(sid)
        except RuntimeError as e:
            if "404" in str(e) or "does not exist" in str(e):
                return None
            raise SubmitError(f"the job server could not say whether {sid} exists: {e}") from e

    def submit(
        self,
        sid: str,
        command: str,
        working_dir: str | None,
        metadata: dict[str, str],
        resubmit_failed: bool = False,
    ) -> str:
        """Submit `command` as `sid`, or attach to the job that has the id already; returns the job's
        status (PENDING | RUNNING | SUCCEEDED | FAILED | STOPPED)."""
        existing = self.info(sid)
        if existing is not None and resubmit_failed and str(existing.status) in ("FAILED", "STOPPED"):
            self._print(f"{sid}: the earlier job ended {existing.status}; submitting it again")
            try:
                self.client.delete_job(sid)
            except RuntimeError:
                pass  # another submitter deleted it first; the submit below settles who runs it
            existing = None
        if existing is not None:
            self._print(f"{sid}: already submitted ({existing.status}); not submitting it again")
            return str(existing.status)
        runtime_env = {"working_dir": working_dir} if working_dir else None
        try:
            self.client.submit_job(
                entrypoint=command, submission_id=sid, runtime_env=runtime_env, metadata=metadata
            )
        except RuntimeError as e:
            if "already exists" not in str(e):
                raise SubmitError(f"the job server refused {sid}: {e}") from e
            # Another submitter of the same slot got there between our look-up and our submit.
            self._print(f"{sid}: submitted by another scheduler just now; attaching to it")
            return str(self.client.get_job_status(sid))
        self._print(f"{sid}: submitted: {command}")
        return "PENDING"

    def wait(self, sid: str) -> int:
        """Follow the job's logs until it ends; return its exit code."""
        try:
            asyncio.run(self._tail(sid))
        except Exception as e:  # noqa: BLE001 - the logs are a convenience; the status decides
            self._print(f"{sid}: log stream ended ({type(e).__name__}: {e}); polling the status")
        while True:
            info = self.client.get_job_info(sid)
            code = exit_code(str(info.status), getattr(info, "driver_exit_code", None))
            if code is not None:
                self._print(
                    f"{sid}: {info.status} (exit {code}){': ' + info.message if info.message else ''}"
                )
                return code
            time.sleep(_POLL_S)

    async def _tail(self, sid: str) -> None:
        async for lines in self.client.tail_job_logs(sid):
            sys.stderr.write(lines)
            sys.stderr.flush()

    def _print(self, line: str) -> None:
        print(f"ditfleet submit: {line}", file=sys.stderr, flush=True)


def submit_slot(
    job_path: str,
    job_name: str,
    address: str | None,
    slot: str,
    wait: bool,
    working_dir: str | None = None,
    resubmit_failed: bool = False,
) -> int:
    """Submit the job of `slot` once (see the module docstring); returns the exit code."""
    sid = submission_id(job_name, slot)
    submitter = SlotSubmitter(address)
    meta = {"ditfleet_job": job_name, "ditfleet_slot": slot}
    status = submitter.submit(sid, entrypoint(job_path, working_dir), working_dir, meta, resubmit_failed)
    if wait:
        return submitter.wait(sid)
    if exit_code(status, None) is None:
        return EXIT_OK
    info = submitter.client.get_job_info(sid)
    return exit_code(str(info.status), getattr(info, "driver_exit_code", None)) or EXIT_OK
