"""A new user's first hour beyond the example job (issue 52): their own job file, their own
columns, the CLI's own help. Each test holds one promise the README or the CLI makes."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ditfleet.jobs.cli import main

TINY_CAPTION = "a small red circle at the top left on a blue background"


def job_with(tmp_path: Path, rows: int = 3, extra: str = "", prompt_column: str = "prompt") -> Path:
    pq.write_table(pa.table({"prompt": [TINY_CAPTION] * rows}), tmp_path / "p.parquet")
    job = tmp_path / "job.yaml"
    job.write_text(
        f"name: mine\ninput:\n  path: {tmp_path / 'p.parquet'}\n  prompt_column: {prompt_column}\n"
        f"output:\n  uri: {tmp_path / 'out'}\n{extra}"
    )
    return job


# `submit` is refused before any job server is asked: the address below is never reached.
COMMANDS = (
    ["validate"],
    ["plan"],
    ["plan", "--json"],
    ["run"],
    ["calibrate"],
    ["submit", "--slot", "s1", "--address", "http://127.0.0.1:9"],
)


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c[:2]))
def test_a_missing_prompt_column_is_the_same_clear_error_through_every_command(tmp_path, capsys, command):
    # Before: `run` read the prompts for the tiny model's word check before validating the input
    # and died on pyarrow's KeyError (exit 1, a traceback).
    job = job_with(tmp_path, prompt_column="caption")
    assert main([command[0], str(job), *command[1:]]) == 2
    err = capsys.readouterr().err
    assert "column 'caption': no 'caption' column (columns: prompt)" in err
    assert "input.prompt_column" in err
    assert "Traceback" not in err and "KeyError" not in err
    assert not (tmp_path / "out").exists()


def test_plan_says_when_fewer_shards_than_actors_and_names_shards_size(tmp_path, capsys):
    # 200 rows at the default 256 rows a shard: one shard, so one of two actors would sit idle.
    job = job_with(tmp_path, rows=200, extra="workers:\n  min: 1\n  max: 2\n")
    assert main(["plan", str(job)]) == 0
    out = capsys.readouterr().out
    assert "in 1 shard of up to 256 rows" in out
    assert (
        "warning: 1 shard for up to 2 actors: 1 actor has nothing to run (a shard runs on one actor). "
        "shards.size is 256 rows; shards.size: 100 (or less) gives every actor a shard."
    ) in out
    assert main(["plan", str(job), "--json"]) == 0
    assert any("shards.size: 100" in w for w in json.loads(capsys.readouterr().out)["warnings"])
    # Enough shards: no warning.
    job = job_with(tmp_path, rows=200, extra="workers:\n  min: 1\n  max: 2\nshards:\n  size: 100\n")
    assert main(["plan", str(job)]) == 0
    assert "warning" not in capsys.readouterr().out
