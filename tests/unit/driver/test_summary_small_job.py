"""The job summary at the example job's scale: a fleet that ran for minutes says minutes, not
"0.0 actor hours (0.0, 0.0, 0.0)"; the model's internals (attention counters) only with --verbose."""

from __future__ import annotations

from ditfleet.driver.output.summary import JobSummary, fleet_line


def test_a_fleet_under_an_hour_is_said_in_minutes_and_seconds():
    fleet = {
        "actors": 2,
        "actor_hours": 112 / 3600,
        "startup_actor_hours": 40 / 3600,
        "generating_actor_hours": 65 / 3600,
        "idle_actor_hours": 7 / 3600,
        "images_per_actor_hour": 1542.86,
    }
    assert fleet_line(fleet) == (
        "1m52s of actor time over 2 actors (start-up 40s, generating 1m05s, idle 7s), "
        "1542.9 images per actor hour"
    )
    big = {**fleet, "actor_hours": 12.5, "startup_actor_hours": 1.2, "generating_actor_hours": 10.9,
           "idle_actor_hours": 0.4}  # fmt: skip
    assert fleet_line(big).startswith(
        "12.5 actor hours over 2 actors (start-up 1.2, generating 10.9, idle 0.4)"
    )


def _summary() -> JobSummary:
    return JobSummary(
        status="succeeded",
        output="out/tiny",
        fingerprint="f",
        shards={
            "planned": 1,
            "committed": 1,
            "committed_before": 0,
            "committed_now": 1,
            "failed": 0,
            "left": 0,
        },
        rows={"planned": 8, "ok": 8, "failed": 0},
        images={"planned": 8, "ok": 8, "failed": 0},
        failures_by_error={},
        failed_shards=[],
        timings={"wall_s": 16.0, "plan_s": 0.1, "dispatch_s": 15.0},
        startup={},
        workers={},
        dispatch={},
        attention={
            "calls": 2880,
            "masked_call_share": 0.0,
            "padded_call_share": 0.306,
            "padded_token_share": 0.0026,
        },
    )


def test_the_attention_counters_print_only_when_verbose():
    summary = _summary()
    assert "DiT attention" not in summary.format_text()
    assert "  DiT attention: 2880 calls, 0.0% with a dense mask, 30.6% padded" in summary.format_text(
        verbose=True
    )
    assert summary.to_dict()["attention"]["calls"] == 2880  # _SUCCESS and --json keep them
