"""The deployment's bucket lifecycle rule, applied to a real S3 endpoint (moto's HTTP server)."""

from __future__ import annotations

import json

from tests.unit.jobs.test_deploy_configs import LIFECYCLE


def test_the_bucket_lifecycle_rule_aborts_unfinished_multipart_uploads(s3_server, s3_bucket):
    doc = json.loads(LIFECYCLE.read_text())
    (rule,) = doc["Rules"]
    assert rule["Status"] == "Enabled" and rule["Filter"] == {"Prefix": ""}
    assert 1 <= rule["AbortIncompleteMultipartUpload"]["DaysAfterInitiation"] <= 7
    # A real S3 API takes it as written (the same call as `aws s3api put-bucket-lifecycle-configuration`).
    s3_server.admin.put_bucket_lifecycle_configuration(Bucket=s3_bucket, LifecycleConfiguration=doc)
    stored = s3_server.admin.get_bucket_lifecycle_configuration(Bucket=s3_bucket)["Rules"]
    assert stored[0]["AbortIncompleteMultipartUpload"] == rule["AbortIncompleteMultipartUpload"]
