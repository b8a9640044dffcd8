"""Resolution and prompt-length buckets: mapping, strict errors, validation, padding."""

import pytest
import torch

from ditfleet.compile.buckets import (
    PROMPT_LENGTH_BUCKETS,
    BucketError,
    BucketSet,
    ResolutionBucket,
    default_buckets,
    prompt_length_bucket,
)
from ditfleet.testing.prompt_padding import pad_prompt_embeds, pad_to_bucket

QWEN = default_buckets("/models/qwen-image")  # any path but "tiny" is Qwen-Image
TINY = default_buckets("tiny")


@pytest.mark.parametrize(
    "buckets, size, expected",
    [
        # exact matches win, whatever else is near
        (QWEN, (1328, 1328), "1328x1328"),
        (QWEN, (1664, 928), "1664x928"),
        (QWEN, (1136, 1472), "1136x1472"),
        (TINY, (96, 160), "96x160"),
        # nearest aspect ratio
        (QWEN, (1024, 1024), "1328x1328"),
        (QWEN, (1920, 1080), "1664x928"),  # 16:9
        (QWEN, (1080, 1920), "928x1664"),  # 9:16
        (QWEN, (800, 600), "1472x1136"),  # 4:3
        (QWEN, (600, 800), "1136x1472"),  # 3:4
        (QWEN, (1500, 1000), "1584x1056"),  # 3:2
        (QWEN, (1000, 1500), "1056x1584"),  # 2:3
        (QWEN, (1400, 1000), "1584x1056"),  # 1.4: log-nearer 3:2 (0.069) than 4:3 (0.077)
        (QWEN, (1200, 1000), "1472x1136"),
        (QWEN, (4000, 1000), "1664x928"),  # wider than every bucket: the widest
        (QWEN, (1000, 4000), "928x1664"),
        (TINY, (512, 512), "128x128"),
        (TINY, (1920, 1080), "160x96"),
        (TINY, (130, 100), "160x96"),  # log 1.3 is 0.248 from 5:3 and 0.262 from 1:1
        (TINY, (1, 1000), "96x160"),
    ],
)
def test_map_table(buckets, size, expected):
    assert buckets.map(*size).name == expected


def test_aspect_tie_is_decided_by_pixel_count_then_order():
    # 2:1 is exactly as far (log 2) from 1:1 as from 4:1; the pixel count decides.
    b = BucketSet((ResolutionBucket(256, 256), ResolutionBucket(1024, 256)))
    assert b.map(200, 100).name == "256x256"  # 20k px: nearer 65k than 262k
    assert b.map(2000, 1000).name == "1024x256"  # 2M px: nearer 262k
    # A square request between a landscape bucket and its portrait twin of equal pixels: list order.
    assert BucketSet((ResolutionBucket(160, 96), ResolutionBucket(96, 160))).map(50, 50).name == "160x96"
    assert BucketSet((ResolutionBucket(96, 160), ResolutionBucket(160, 96))).map(50, 50).name == "96x160"


def test_default_is_first_and_names():
    assert QWEN.default() == ResolutionBucket(1328, 1328)
    assert TINY.default().name == "128x128"
    assert TINY.names == ("128x128", "160x96", "96x160")
    assert BucketSet.from_names(["160x96", "128x128"]).default().name == "160x96"
    assert TINY.get("160x96") == ResolutionBucket(160, 96)


def test_all_defined_buckets_are_multiples_of_16_with_even_latent_grids():
    for b in (*QWEN, *TINY):
        assert b.width % 16 == 0 and b.height % 16 == 0
        assert (b.width // 8) % 2 == 0 and (b.height // 8) % 2 == 0
    # Qwen-Image's 4:3 recommendation 1472x1140 is kept as close as a multiple of 16 allows.
    assert ResolutionBucket(1472, 1136) in QWEN.buckets


def test_strict_mode_error_names_size_and_lists_buckets():
    strict = default_buckets("tiny", strict=True)
    assert strict.map(160, 96).name == "160x96"
    with pytest.raises(BucketError) as e:
        strict.map(1000, 700)
    msg = str(e.value)
    assert "1000x700" in msg
    assert "128x128, 160x96, 96x160" in msg
    assert "strict" in msg


@pytest.mark.parametrize(
    "width, height, bad",
    [(1472, 1140, "1140"), (100, 128, "100"), (0, 128, "0"), (128, -16, "-16")],
)
def test_bucket_sides_must_be_positive_multiples_of_16(width, height, bad):
    with pytest.raises(BucketError, match=rf" {bad} is not a positive multiple of 16"):
        ResolutionBucket(width, height)


def test_bucket_set_definition_errors():
    with pytest.raises(BucketError, match="at least one"):
        BucketSet(())
    with pytest.raises(BucketError, match="128x128 listed more than once"):
        BucketSet.from_names(["128x128", "160x96", "128x128"])
    with pytest.raises(BucketError, match="'WIDTHxHEIGHT'"):
        ResolutionBucket.parse("128 by 128")
    with pytest.raises(BucketError, match="positive integer"):
        TINY.map(0, 128)
    with pytest.raises(BucketError, match="not in this job's buckets"):
        TINY.get("1328x1328")


def test_prompt_length_bucket():
    assert PROMPT_LENGTH_BUCKETS == (16, 32, 64, 128, 256, 512, 1024)
    assert [prompt_length_bucket(n) for n in (0, 1, 64, 65, 128, 200, 513, 1024)] == [
        16,
        16,
        64,
        128,
        128,
        256,
        1024,
        1024,
    ]
    with pytest.raises(BucketError, match=r"1025 tokens.*largest prompt-length bucket \(1024 tokens\)"):
        prompt_length_bucket(1025)
    assert prompt_length_bucket(20, buckets=(16, 32)) == 32


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int64])
def test_pad_prompt_embeds_shapes_values_and_mask(mask_dtype):
    g = torch.Generator().manual_seed(0)
    embeds = torch.randn(2, 5, 8, generator=g)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]).to(mask_dtype)
    padded, padded_mask = pad_prompt_embeds(embeds, mask, 64)
    assert padded.shape == (2, 64, 8) and padded_mask.shape == (2, 64)
    assert padded.dtype == embeds.dtype and padded_mask.dtype == mask_dtype
    assert torch.equal(padded[:, :5], embeds)
    assert torch.count_nonzero(padded[:, 5:]) == 0
    assert torch.equal(padded_mask[:, :5], mask)
    assert not padded_mask[:, 5:].bool().any()
    # Already at the bucket length: unchanged.
    same, same_mask = pad_prompt_embeds(padded, padded_mask, 64)
    assert same is padded and same_mask is padded_mask


def test_pad_to_bucket_picks_the_bucket():
    embeds = torch.ones(3, 130, 4)
    mask = torch.ones(3, 130, dtype=torch.bool)
    padded, padded_mask = pad_to_bucket(embeds, mask)
    assert padded.shape == (3, 256, 4)
    assert int(padded_mask.sum()) == 3 * 130


def test_pad_errors():
    with pytest.raises(BucketError, match="more than the bucket length 64"):
        pad_prompt_embeds(torch.zeros(1, 65, 4), torch.ones(1, 65, dtype=torch.bool), 64)
    with pytest.raises(BucketError, match=r"mask shape \(1, 4\) does not match"):
        pad_prompt_embeds(torch.zeros(1, 5, 4), torch.ones(1, 4, dtype=torch.bool), 64)
    with pytest.raises(BucketError, match=r"\(B, L, D\)"):
        pad_to_bucket(torch.zeros(5, 4), torch.ones(5, dtype=torch.bool))
