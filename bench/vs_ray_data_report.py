"""The table bench/vs_ray_data.py prints: ditfleet and the Ray Data baseline side by side."""

from __future__ import annotations

from typing import Any


def _fmt(v: Any, unit: str = "") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.2f}{unit}"
    return f"{v}{unit}"


def _ratio(a: Any, b: Any, higher_is_better: bool = True) -> str:
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)) or not a or not b:
        return ""
    return f"{(a / b if higher_is_better else b / a):.2f}x"


def _redone(run: dict[str, Any]) -> str:
    if run["path"] == "ditfleet":
        what = f"{run['shards_rerun']} shard(s) re-run"
    else:
        what = f"{run['rows_rerun']} rows re-generated"
    rewritten = f"{run['objects_rewritten']} objects rewritten"
    if run["objects_rewritten"]:
        rewritten += f" ({run['objects_rewritten_different']} with other bytes)"
    return f"{what}; {rewritten}"


def _per_s(run: dict[str, Any]) -> float | None:
    ms = run["serving_cpu_ms_per_image"]
    return round(1000 / ms, 2) if ms else None


def _ray_ms(run: dict[str, Any]) -> float | None:
    """CPU of the job's other Ray processes (the baseline's read and write tasks run there)."""
    return round(1000 * run["cpu_s"]["ray_other"] / max(run["images_stored"], 1), 1)


def _row(label: str, d: Any, b: Any, unit: str = "", better: str | None = None) -> tuple[str, str, str, str]:
    """better: "higher" or "lower" adds ditfleet's advantage as a ratio (> 1: ditfleet better)."""
    ratio = _ratio(d, b, higher_is_better=better == "higher") if better else ""
    return (label, _fmt(d, unit), _fmt(b, unit), ratio)


def format_table(result: dict[str, Any]) -> str:
    runs = result["runs"]
    d, b = runs["ditfleet-clean"], runs["ray_data-clean"]
    ident = result["identity"]
    n = result["images"]
    head = (
        f"ditfleet ({result['ditfleet_format']} output) vs Ray Data map_batches + diffusers: {n} images "
        f"({result['buckets']}), {result['steps']} steps, CFG {result['true_cfg_scale']}, "
        f"{result['actors']} actors, batch {result['batch_size']}, {result['device']}, model: {result['model']}"
    )
    rows: list[tuple[str, str, str, str]] = [
        ("images stored", f"{d['images_stored']}/{n}", f"{b['images_stored']}/{n}", ""),
        _row("job wall time, launch -> exit", d["wall_s"], b["wall_s"], " s", "lower"),
        _row("images/s, whole job", d["images_per_s_job"], b["images_per_s_job"], "", "higher"),
        _row("time to first image stored", d["first_image_s"], b["first_image_s"], " s", "lower"),
        _row(
            "actor start-up CPU, per actor", d["actor_startup_cpu_s"], b["actor_startup_cpu_s"], " s", "lower"
        ),
        _row(
            "actor CPU per image, serving",
            d["serving_cpu_ms_per_image"],
            b["serving_cpu_ms_per_image"],
            " ms",
            "lower",
        ),
        _row("images/s per actor core, serving", _per_s(d), _per_s(b), "", "higher"),
        _row("Ray tasks + daemons CPU per image", _ray_ms(d), _ray_ms(b), " ms", "lower"),
        _row(
            "all CPU per image (start-up, driver, Ray)",
            d["total_cpu_ms_per_image"],
            b["total_cpu_ms_per_image"],
            " ms",
            "lower",
        ),
        _row("driver peak RSS", d["driver_peak_rss_mb"], b["driver_peak_rss_mb"], " MB"),
        _row("actor peak RSS (max)", d["actor_peak_rss_mb"], b["actor_peak_rss_mb"], " MB"),
        (
            "pixels vs diffusers, same seeds",
            f"max |diff| {ident['max_abs_diff']}/255, {ident['images_differing']} of {ident['compared']} differ",
            "(reference)",
            "",
        ),
    ]
    if "ditfleet-kill" in runs:
        dk, bk = runs["ditfleet-kill"], runs["ray_data-kill"]

        def extra(k: dict[str, Any], c: dict[str, Any]) -> str:
            return f"{k['wall_s'] - c['wall_s']:+.1f} s wall, {k['cpu_s']['total'] - c['cpu_s']['total']:+.1f} s CPU"

        def when(k: dict[str, Any]) -> str:
            if k["killed_pid"] is None:
                return "not killed: no actor was busy once half was stored"
            return f"{k['stored_at_kill']}/{n}"

        rows += [
            ("KILL one actor when stored", when(dk), when(bk), ""),
            ("KILL: job exit code", str(dk["returncode"]), str(bk["returncode"]), ""),
            ("KILL: rows lost", str(dk["rows_lost"]), str(bk["rows_lost"]), ""),
            ("KILL: ids stored twice", str(dk["rows_duplicated"]), str(bk["rows_duplicated"]), ""),
            ("KILL: metadata rows", f"{dk['metadata_rows']}/{n}", f"{bk['metadata_rows']}/{n}", ""),
            ("KILL: work redone", _redone(dk), _redone(bk), ""),
            ("KILL: cost vs clean run", extra(dk, d), extra(bk, b), ""),
        ]
    header = ("", "ditfleet", "ray data + diffusers", "ditfleet better by")
    widths = [max(len(r[i]) for r in [*rows, header]) for i in range(4)]
    line = "  ".join("-" * w for w in widths)
    out = [head, line, "  ".join(h.ljust(w) for h, w in zip(header, widths)), line]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    out.append(line)
    out.append("clean rounds (the table shows the median round by wall time):")
    for path, r in result["rounds"].items():
        out.append(
            f"  {path:<9} wall {r['wall_s']} s, first image {r['first_image_s']} s, serving CPU/image "
            f"{r['serving_cpu_ms_per_image']} ms, all CPU/image {r['total_cpu_ms_per_image']} ms"
        )
    same = {p: ident.get(f"{p}_rounds_bit_identical") for p in ("ditfleet", "ray_data")}
    if same["ditfleet"] is not None:
        out.append(
            f"  same PNG bytes in every round: ditfleet {same['ditfleet']}, ray data {same['ray_data']}"
        )
    if result.get("profile"):
        out.append(format_profile(result["profile"]))
    return "\n".join(out)


def format_profile(profile: dict[str, Any]) -> str:
    """In-process split of one batch's time, CPU ms per image."""
    lines = [f"profile, one {profile['bucket']} batch of {profile['batch']}, {profile['clock']} per image:"]
    for name, stages in profile["pipelines"].items():
        parts = ", ".join(f"{k} {v:.1f}" for k, v in stages.items())
        lines.append(f"  {name:<42} {parts}")
    return "\n".join(lines)
