"""A new user's first hour beyond the example job (issue 52): their own job file, their own
columns, the CLI's own help. Each test holds one promise the README or the CLI makes."""

from __future__ import annotations

import json
import socket
import time
from importlib.metadata import version
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image, ImageDraw
from ray._private import services as ray_services

from ditfleet.jobs.cli import main
from ditfleet.jobs.preview import caption_font
from ditfleet.jobs.run import interrupted_note
from ditfleet.model.tiny.known_words import unknown_words_warning
from ditfleet.workers.output.layout import manifest_key
from ditfleet.workers.storage import open_store
from tests.support.paths import REPO

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


def free_port() -> int:
    """A port nothing listens on: bound, then released (never listened on)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_address_where_nothing_answers_ends_at_the_deadline_with_exit_2(tmp_path, capsys):
    # Before: ray.init at a dead address retried with no end a user could see.
    job = job_with(tmp_path)
    address = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    assert main(["run", str(job), "--address", address, "--connect-timeout", "1"]) == 2
    took = time.monotonic() - started
    err = capsys.readouterr().err
    assert f"no Ray cluster at {address}: nothing answered for 1 s" in err
    assert "Check that the head is running" in err and "Nothing was written" in err
    assert "Traceback" not in err
    assert 1 <= took < 30
    assert not (tmp_path / "out").exists()


def test_a_stale_ray_current_cluster_file_behind_address_auto_is_named(tmp_path, capsys, monkeypatch):
    # A head stopped without `ray stop` leaves its address in <ray temp>/ray_current_cluster.
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text(f"127.0.0.1:{free_port()}")
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    # `auto` also takes any GCS process Ray finds running on this machine over the file (another
    # engineer's cluster on a shared machine): the user's machine here runs none.
    monkeypatch.setattr(ray_services, "find_gcs_addresses", frozenset)
    job = job_with(tmp_path)
    assert main(["run", str(job), "--address", "auto", "--connect-timeout", "0.5"]) == 2
    err = capsys.readouterr().err
    assert "no Ray cluster at auto (127.0.0.1:" in err
    assert "ray_current_cluster" in err and "`ray stop` removes it" in err


def test_ctrl_c_speaks_of_committed_shards_only_when_there_are_some(tmp_path):
    job = job_with(tmp_path)
    assert interrupted_note(str(job)) == (
        f"interrupted before any shard was committed to {tmp_path / 'out'}; run the same command again to start"
    )
    store = open_store(str(tmp_path / "out"))
    store.put(manifest_key(0), b"")  # a committed shard: its manifest exists (the commit)
    assert interrupted_note(str(job)) == (
        f"interrupted; the 1 shard committed to {tmp_path / 'out'} are kept: run the same command again to resume"
    )


def test_ditfleet_alone_prints_the_commands_and_version_says_the_version(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    for command in ("validate", "plan", "run", "submit", "status", "verify", "preview", "report"):
        assert f"    {command}" in out
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"ditfleet {version('ditfleet')}"


@pytest.mark.parametrize("command", ["validate", "plan", "run"])
def test_the_job_commands_help_describes_their_argument(capsys, command):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    assert "job file (YAML or JSON; its keys: docs/job-file.md)" in " ".join(capsys.readouterr().out.split())


def test_verify_workers_default_is_the_same_in_help_and_docs(capsys):
    with pytest.raises(SystemExit):
        main(["verify", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    default = "default: one per CPU core for a local output, 16 for S3"
    assert default in help_text
    assert default in " ".join((REPO / "docs" / "reliability.md").read_text().split())
    assert "(default 16)" not in (REPO / "docs" / "reliability.md").read_text()


def test_a_relative_input_path_that_is_not_there_says_where_relative_paths_start(
    tmp_path, capsys, monkeypatch
):
    (tmp_path / "jobs").mkdir()
    job = tmp_path / "jobs" / "job.yaml"
    job.write_text("input:\n  path: prompts.parquet\noutput:\n  uri: out\n")  # beside the job file: not found
    pq.write_table(pa.table({"prompt": [TINY_CAPTION]}), tmp_path / "jobs" / "prompts.parquet")
    monkeypatch.chdir(tmp_path)
    assert main(["run", str(job)]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'prompts.parquet'}: no such file or directory" in err
    assert (
        f"input.path 'prompts.parquet' is relative, and relative paths start at the current directory "
        f"({tmp_path}), not at the job file's folder"
    ) in err


def test_the_unknown_words_line_agrees_in_number():
    assert unknown_words_warning(["cat"], 1, 1).startswith(
        "1 of 1 prompt uses words the tiny model does not know"
    )
    assert unknown_words_warning(["cat"], 2, 3).startswith("2 of 3 prompts use words")


def test_the_contact_sheet_caption_font_keeps_every_word_space_wider_than_any_letter_gap():
    # Before: Pillow's default 10 px font squeezed some spaces to a pixel ("smallyellow").
    caption = "a small yellow triangle at the top left"
    image = Image.new("L", (400, 24), 255)
    ImageDraw.Draw(image).text((2, 2), caption, fill=0, font=caption_font())
    inked = (np.asarray(image) < 160).any(axis=0)
    gaps, run, seen_ink = [], 0, False
    for column in inked:
        if column:
            if seen_ink and run:
                gaps.append(run)
            seen_ink, run = True, 0
        else:
            run += 1
    spaces = caption.count(" ")
    word_gaps, letter_gaps = sorted(gaps)[-spaces:], sorted(gaps)[:-spaces]
    assert min(word_gaps) > max(letter_gaps), gaps
