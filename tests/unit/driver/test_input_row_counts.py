"""A Parquet footer whose row counts disagree with the rows its pages hold is refused by
validation and planning, naming the file and the row group, before any shard is planned.

pyarrow reads a row group's pages whatever its footer says, so a footer claiming
2,000,000,000 rows over 8 real ones would otherwise plan shards for rows that do not exist
("8 ok of 2000000000"). The forged files are real Parquet with a rewritten footer
(tests/support/forged_parquet.py)."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from ditfleet.compile.buckets import default_buckets
from ditfleet.driver.input.prompts import PromptSource
from ditfleet.driver.input.row_errors import InputError
from ditfleet.driver.input.scan import validate_input
from ditfleet.driver.plan import PlanConfig, plan_job
from ditfleet.workers.rows import RowConfig
from tests.support.forged_parquet import footer_counts, write_forged_prompts

CONFIG = RowConfig(buckets=default_buckets("tiny"))
BIG = 2_000_000_000


def _problems(path) -> str:
    report = validate_input(PromptSource(str(path)), CONFIG)
    assert not report.ok
    return "\n".join(str(e) for e in report.errors)


def test_the_forged_footer_is_what_pyarrow_believes_and_the_pages_are_not(tmp_path):
    path = write_forged_prompts(tmp_path / "p.parquet", 8, file_rows=BIG)
    assert footer_counts(path) == (BIG, [8])
    pf = pq.ParquetFile(path)
    assert pf.metadata.num_rows == BIG and sum(b.num_rows for b in pf.iter_batches()) == 8


def test_a_file_count_over_its_row_groups_is_refused_from_the_footer_alone(tmp_path):
    path = write_forged_prompts(tmp_path / "p.parquet", 8, file_rows=BIG)
    text = _problems(path)
    assert str(path) in text and f"says {BIG} rows but its row groups hold 8" in text
    assert "write the file again" in text
    with pytest.raises(InputError, match=f"says {BIG} rows but its row groups hold 8"):
        plan_job(PromptSource(str(path)), PlanConfig(rows=CONFIG, shard_size=4))


@pytest.mark.parametrize("lying_group", [0, 1])
def test_a_row_group_claiming_more_rows_than_it_holds_is_refused_naming_it(tmp_path, lying_group):
    # The file's count agrees with the row groups', so only reading finds the lie.
    claims = {lying_group: BIG}
    path = write_forged_prompts(
        tmp_path / "p.parquet", 8, row_group_size=4, file_rows=BIG + 4, group_rows=claims
    )
    text = _problems(path)
    assert f"{path}: row group {lying_group}: its footer says {BIG} rows but its pages hold 4" in text
    with pytest.raises(InputError, match=f"row group {lying_group}: its footer says {BIG} rows"):
        plan_job(PromptSource(str(path)), PlanConfig(rows=CONFIG, shard_size=4))


def test_the_other_files_are_still_checked_and_a_true_footer_passes(tmp_path):
    (tmp_path / "in").mkdir()
    good = write_forged_prompts(tmp_path / "in" / "a.parquet", 8)
    assert validate_input(PromptSource(str(good)), CONFIG).ok  # the rewrite alone changes nothing
    write_forged_prompts(tmp_path / "in" / "b.parquet", 8, file_rows=BIG)
    report = validate_input(PromptSource(str(tmp_path / "in")), CONFIG)
    assert report.total >= 1 and all("b.parquet" in e.file for e in report.errors)
    plan = plan_job(PromptSource(str(good)), PlanConfig(rows=CONFIG, shard_size=4))
    assert plan.total_rows == 8 and len(plan.shards) == 2


def test_a_claim_too_large_to_check_for_duplicate_ids_is_a_problem_not_a_traceback(tmp_path):
    claim = 10**11  # 745 GiB of id digests
    path = write_forged_prompts(tmp_path / "p.parquet", 8, file_rows=claim, group_rows={0: claim})
    text = _problems(path)
    assert f"{path}: the footers claim {claim} rows in all, more than this machine can check" in text
