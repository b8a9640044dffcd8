"""Planning an input that lives in S3, through a real S3 endpoint (moto's HTTP server)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ditfleet.driver.input.prompts import PromptSource
from ditfleet.driver.input.row_errors import InputError
from ditfleet.driver.plan import PlanConfig, plan_job
from ditfleet.workers.storage.input_files import filesystem_for
from tests.unit.driver.test_plan import ROWS, all_rows


def test_s3_input_through_a_real_s3_endpoint(s3_server, s3_bucket):
    for name, prompts in (("b.parquet", ["b0", "b1", "b2"]), ("a.parquet", ["a0", "a1"])):
        sink = pa.BufferOutputStream()
        pq.write_table(pa.table({"prompt": prompts}), sink)
        s3_server.admin.put_object(Bucket=s3_bucket, Key=f"prompts/{name}", Body=sink.getvalue().to_pybytes())
    s3_server.admin.put_object(Bucket=s3_bucket, Key="prompts/_SUCCESS", Body=b"")
    uri = f"s3://{s3_bucket}/prompts/*.parquet"
    fs = filesystem_for(uri, endpoint_url=s3_server.endpoint_url)
    plan = plan_job(PromptSource(uri, fs), PlanConfig(rows=ROWS, shard_size=2))
    assert [i.uri for i in plan.inputs] == [
        f"s3://{s3_bucket}/prompts/a.parquet",
        f"s3://{s3_bucket}/prompts/b.parquet",
    ]
    assert [r.prompt for r in all_rows(plan, fs)] == ["a0", "a1", "b0", "b1", "b2"]
    assert plan_job(PromptSource(f"s3://{s3_bucket}/prompts", fs), PlanConfig(rows=ROWS)).total_rows == 5
    with pytest.raises(InputError, match=rf"s3://{s3_bucket}/nothing: no such file or directory"):
        plan_job(PromptSource(f"s3://{s3_bucket}/nothing", fs), PlanConfig(rows=ROWS))
