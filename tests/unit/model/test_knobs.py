"""The one check (model.knobs.check_settings): every config's Literal fields and bounds, knobs and
plain `bounded` fields alike, are refused with the same message naming the class and field; a
config restates by hand only what relates two fields."""

from __future__ import annotations

import dataclasses

import pytest

from ditfleet.compile.config import CompileConfig
from ditfleet.driver.dispatch import DispatchConfig
from ditfleet.driver.plan import PlanConfig
from ditfleet.model.knobs import BOUNDS, bounded
from ditfleet.workers.output.formats import ShardWriterConfig
from ditfleet.workers.storage import S3Config

REFUSED = [
    (CompileConfig, {"vae_batch": 0}, "CompileConfig.vae_batch must be >= 1, got 0"),
    (CompileConfig, {"claim_timeout_s": -1.0}, "CompileConfig.claim_timeout_s must be >= 0"),
    (CompileConfig, {"vae_mode": "fast"}, "CompileConfig.vae_mode must be one of"),
    (CompileConfig, {"dit": 1}, r"CompileConfig.dit must be one of \(True, False, 'auto'\), got 1"),
    (ShardWriterConfig, {"threads": 0}, "ShardWriterConfig.threads must be >= 1"),
    (ShardWriterConfig, {"row_group_bytes": 0}, "ShardWriterConfig.row_group_bytes must be >= 1"),
    (ShardWriterConfig, {"output_format": "lance"}, "ShardWriterConfig.output_format must be one of"),
    (S3Config, {"multipart_chunksize": 1024}, "S3Config.multipart_chunksize must be >= 5242880"),
    (S3Config, {"list_page_size": 1001}, "S3Config.list_page_size must be <= 1000"),
    (S3Config, {"read_timeout_s": 0.0}, "S3Config.read_timeout_s must be > 0"),
    (
        S3Config,
        {"response_checksum_validation": "always"},
        "S3Config.response_checksum_validation must be one",
    ),
    (
        S3Config,
        {"multipart_threshold": 6 * 2**20},
        "S3Config.multipart_threshold must be >= multipart_chunksize",
    ),
    (DispatchConfig, {"tick_s": 0.0}, "DispatchConfig.tick_s must be > 0"),
    (DispatchConfig, {"shard_timeout_s": -5.0}, "DispatchConfig.shard_timeout_s must be > 0"),
    (DispatchConfig, {"num_gpus": -1.0}, "DispatchConfig.num_gpus must be >= 0"),
    (DispatchConfig, {"min_actors": 3, "max_actors": 2}, "DispatchConfig.max_actors must be >= min_actors"),
    (PlanConfig, {"read_batch_rows": 0}, "PlanConfig.read_batch_rows must be >= 1"),
    (PlanConfig, {"shard_size": True}, "PlanConfig.shard_size must be a finite number"),
    (PlanConfig, {"shard_size": 2.5}, "PlanConfig.shard_size must be a whole number"),
]


@pytest.mark.parametrize(("cls", "changes", "message"), REFUSED, ids=lambda v: getattr(v, "__name__", None))
def test_each_config_refuses_through_the_one_check(cls, changes, message) -> None:
    with pytest.raises(ValueError, match=message):
        cls(**changes)


def test_the_defaults_and_the_edges_pass() -> None:
    CompileConfig(vae_batch=None, claim_timeout_s=0.0, dit_mode="max-autotune", dit=True)
    S3Config(multipart_chunksize=5 * 2**20, multipart_threshold=5 * 2**20, list_page_size=1)
    DispatchConfig(shard_timeout_s=None, fence_timeout_s=0.0, num_gpus=0.5)
    PlanConfig(shard_size=1, max_errors=1)
    ShardWriterConfig(output_format="webdataset", max_in_flight=1)


def test_bounded_marks_a_plain_field() -> None:
    f = dataclasses.field(default=1)
    assert "ge" not in f.metadata
    g = bounded(1, ge=1)
    assert dict(g.metadata) == {"ge": 1} and "description" not in g.metadata
    with pytest.raises(TypeError, match="bounds"):
        bounded(1)
    with pytest.raises(TypeError, match="bounds"):
        bounded(1, at_least=1)
    assert set(BOUNDS) == {"ge", "gt", "le", "lt"}
