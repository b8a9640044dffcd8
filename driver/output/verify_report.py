"""What `ditfleet verify` found, as the report it prints (text or JSON) and its exit code; filled
in by driver.output.verify."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MAX_LISTED = 20  # problems (and orphans) printed one per line; the rest are counted


@dataclass
class VerifyReport:
    output: str
    planned_shards: int | None = None
    committed: int = 0
    missing: list[int] = field(default_factory=list)  # planned shards without a manifest
    rows: int = 0
    images_ok: int = 0
    images_failed: int = 0
    objects_checked: int = 0  # ok rows whose bytes were read and hashed
    success: bool = False  # _SUCCESS is there
    problems: list[str] = field(default_factory=list)
    orphans: list[str] = field(default_factory=list)  # keys: attempt objects no manifest names
    pending: int = 0  # attempt objects of shards not committed yet
    cleaned: int = 0  # orphans deleted (--clean)
    partial: bool = False  # a running or unfinished output is fine
    moved_from: str | None = None  # the manifests name objects under another root (a copy)
    stale_success: str | None = None  # why a `_SUCCESS` there is not believed (driver.output.success)
    superseded: int = 0  # generations whose supersession --clean did or finished
    sealed: int = 0  # abandoned redo generations --clean sealed
    # Objects superseded generations name that their history under _superseded/ lacks: lost
    # before the redo that replaced them (usually why it ran); history, not the current output.
    history_missing: list[str] = field(default_factory=list)
    # Superseded generations whose copy under _superseded/ was deleted (by hand or a lifecycle
    # rule): nothing reads it, so this is a note, not a problem.
    history_deleted: int = 0

    @property
    def complete(self) -> bool:
        return self.success and not self.missing

    @property
    def exit_code(self) -> int:
        return 0 if not self.problems and (self.complete or self.partial) else 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "output": self.output,
            "ok": self.exit_code == 0,
            "complete": self.complete,
            "shards": {
                "planned": self.planned_shards,
                "committed": self.committed,
                "missing": len(self.missing),
            },
            "rows": self.rows,
            "images": {"ok": self.images_ok, "failed": self.images_failed},
            "objects_checked": self.objects_checked,
            "success_marker": self.success,
            "problems": self.problems,
            "orphans": len(self.orphans),
            "orphans_cleaned": self.cleaned,
            "pending_attempt_objects": self.pending,
            "moved_from": self.moved_from,
            "stale_success": self.stale_success,
            "superseded_now": self.superseded,
            "sealed_now": self.sealed,
            "history_missing": len(self.history_missing),
            "history_deleted": self.history_deleted,
        }

    def format_text(self) -> str:
        verdict = "OK" if self.exit_code == 0 else ("PROBLEMS" if self.problems else "INCOMPLETE")
        planned = "?" if self.planned_shards is None else str(self.planned_shards)
        lines = [
            f"verify {self.output}: {verdict}",
            f"  shards:  {self.committed} committed of {planned}, {len(self.missing)} missing",
            f"  rows:    {self.rows} (each exactly once); images {self.images_ok} ok, "
            f"{self.images_failed} failed; {self.objects_checked} objects hashed",
            f"  _SUCCESS: {'present' if self.success else 'absent'}",
        ]
        if self.stale_success:
            lines.append(f"  note: {self.stale_success}")
        if self.superseded or self.sealed:
            lines.append(
                f"  --clean: {self.superseded} superseded generation(s) moved under _superseded/, "
                f"{self.sealed} abandoned redo generation(s) sealed"
            )
        if self.history_missing:
            lines.append(
                f"  history: {len(self.history_missing)} objects of superseded generations are not "
                f"under _superseded/ (lost before the redo that replaced them; e.g. {self.history_missing[0]})"
            )
        if self.history_deleted:
            lines.append(
                f"  history: {self.history_deleted} superseded generation(s) have no copy under "
                "_superseded/ (deleted; nothing needs it)"
            )
        if self.moved_from:
            lines.append(
                f"  note: the manifests name objects under {self.moved_from} (a moved or copied output)"
            )
        if self.missing and not self.problems:
            lines.append(
                f"  not complete: {len(self.missing)} shards not committed yet; run the job again "
                "(or wait for it) to finish them"
            )
        if self.orphans:
            what = f"{self.cleaned} deleted" if self.cleaned else "harmless; --clean deletes them"
            lines.append(
                f"  orphans: {len(self.orphans)} objects of losing/late runs no manifest names ({what})"
            )
            lines.extend(f"    {k}" for k in self.orphans[:MAX_LISTED] if not self.cleaned)
        if self.pending:
            lines.append(f"  pending: {self.pending} objects of runs of uncommitted shards (kept)")
        lines.extend(f"  PROBLEM: {p}" for p in self.problems[:MAX_LISTED])
        if len(self.problems) > MAX_LISTED:
            lines.append(f"  ... and {len(self.problems) - MAX_LISTED} more problems")
        return "\n".join(lines)
