"""The DiT attends without a dense mask: unmasked when nothing is padded, split by text length
when something is, and both match the dense-mask reference within fp32 tolerance."""

from __future__ import annotations

import pytest
import torch

from ditfleet.model import load_pipeline
from ditfleet.model.qwen_image.attention import AttentionStats, TextPadding, joint_attention
from ditfleet.model.qwen_image.transformer import QwenImageTransformer, TransformerConfig
from ditfleet.testing.models import TINY_TRANSFORMER


def _mask(lengths: list[int], L: int) -> torch.Tensor:
    m = torch.zeros(len(lengths), L, dtype=torch.long)
    for i, n in enumerate(lengths):
        m[i, :n] = 1
    return m


def test_padding_plan_kinds():
    none = TextPadding.build(None, 2, 5, 16)
    ones = TextPadding.build(torch.ones(2, 5), 2, 5, 16)
    assert not none.padded and not ones.padded and ones.dense_mask is None
    split = TextPadding.build(_mask([3, 3, 5, 4], 5), 4, 5, 16)
    assert split.runs == ((0, 2, 3), (2, 3, 5), (3, 4, 4)) and split.dense_mask is None
    assert split.padded_tokens == 2 + 2 + 0 + 1
    holes = torch.tensor([[1, 0, 1, 1, 1], [1, 1, 1, 1, 1]])  # not a prefix: only a dense mask is right
    dense = TextPadding.build(holes, 2, 5, 16)
    assert dense.dense_mask is not None and dense.dense_mask.shape == (2, 1, 1, 21)
    with pytest.raises(ValueError, match="padded attention"):
        TextPadding.build(split_mask := _mask([1, 2], 2), 2, 2, 4, mode="flex")  # noqa: F841


def test_split_attention_matches_dense_mask():
    g = torch.Generator().manual_seed(0)
    B, H, hd, N, L = 4, 3, 16, 12, 7
    q, k, v = (torch.randn(B, H, N + L, hd, generator=g) for _ in range(3))
    mask = _mask([7, 4, 4, 2], L)
    reference = joint_attention(q, k, v, TextPadding.build(mask, B, L, N, mode="mask"))
    stats = AttentionStats()
    got = joint_attention(q, k, v, TextPadding.build(mask, B, L, N), stats)
    real = torch.cat([torch.ones(B, N, dtype=torch.bool), mask.bool()], dim=1)  # (B, N + L)
    assert torch.allclose(
        got[real[:, None, :, None].expand_as(got)],
        reference[real[:, None, :, None].expand_as(got)],
        atol=1e-6,
    )
    assert stats.calls == 1 and stats.split_calls == 1 and stats.masked_calls == 0
    assert stats.padded_tokens == 0 + 3 + 3 + 5 and stats.text_tokens == B * L


def test_transformer_split_matches_mask_reference_and_counts():
    torch.manual_seed(0)
    config = TransformerConfig(**{**TINY_TRANSFORMER, "axes_dims_rope": (8, 4, 4)})
    model = QwenImageTransformer(config).eval()
    B, h, w, L = 3, 4, 6, 9
    x = torch.randn(B, h * w, 64)
    txt = torch.randn(B, L, 16)
    mask = _mask([9, 5, 5], L)
    t = torch.tensor([0.4])
    shapes = [[(1, h, w)]] * B
    with torch.no_grad():
        model.padded_attention = "mask"
        reference = model(x, txt, mask, t, shapes)
        model.padded_attention = "split"
        before = model.attention_stats.to_dict()
        got = model(x, txt, mask, t, shapes)
        split = model.attention_stats.since(before)
        before = model.attention_stats.to_dict()
        model(x, txt, None, t, shapes)
        plain = model.attention_stats.since(before)
    assert (got - reference).abs().max().item() <= 1e-5
    layers = config.num_layers
    assert split["calls"] == layers and split["split_calls"] == layers and split["masked_calls"] == 0
    assert split["padded_tokens"] == layers * 8
    assert (
        plain["calls"] == layers
        and plain["split_calls"] == plain["masked_calls"] == plain["padded_tokens"] == 0
    )


@pytest.mark.slow
def test_images_without_mask_match_masked_reference(random_model_dir):
    """A padded batch through the split kernel, and each prompt alone with no padding at all,
    give the images of the dense-mask reference within fp32 tolerance."""
    pipe = load_pipeline(random_model_dir)
    g = torch.Generator().manual_seed(3)
    lengths = [6, 6, 3]
    embeds = torch.randn(3, 6, 16, generator=g)
    mask = _mask(lengths, 6)
    embeds = embeds * mask[..., None]
    neg = torch.randn(1, 2, 16, generator=g).expand(3, 2, 16)
    kw = dict(height=32, width=48, steps=2, true_cfg_scale=4.0, seeds=[5, 6, 7])
    inputs = dict(prompt_embeds=embeds, prompt_embeds_mask=mask, negative_prompt_embeds=neg)
    pipe.transformer.padded_attention = "mask"
    reference = pipe.generate(**inputs, **kw)
    pipe.transformer.padded_attention = "split"
    stats = pipe.transformer.attention_stats
    before = stats.to_dict()
    split = pipe.generate(**inputs, **kw)
    counts = stats.since(before)
    assert (split - reference).abs().max().item() <= 1e-4
    assert counts["masked_calls"] == 0 and counts["split_calls"] == 2 * 2  # cond pass of 2 steps x 2 blocks
    assert counts["calls"] == 2 * 2 * 2  # uncond passes share one prompt: never padded
    before = stats.to_dict()
    alone = pipe.generate(
        prompt_embeds=embeds[2:, :3], negative_prompt_embeds=neg[2:], **{**kw, "seeds": [7]}
    )
    assert stats.since(before)["split_calls"] == stats.since(before)["masked_calls"] == 0
    assert (alone - reference[2:]).abs().max().item() <= 1e-4


def _requests(lengths: list[int], bucket=(32, 32), cfg: float = 4.0):
    from ditfleet.workers.generate import ImageRequest
    from ditfleet.workers.rows import PromptRow

    rows = [
        PromptRow(
            id=f"r{i}",
            prompt=" ".join(["red"] * (n - 1)),
            negative_prompt=" ",
            seed=i,
            width=bucket[0],
            height=bucket[1],
            requested_width=None,
            requested_height=None,
            bucket=f"{bucket[0]}x{bucket[1]}",
            steps=2,
            true_cfg_scale=cfg,
            num_images=1,
            file="f",
            row=i,
        )  # fmt: skip
        for i, n in enumerate(lengths)
    ]
    return [ImageRequest(r, 0) for r in rows]


def _word_count(prompts: list[str]) -> list[int]:
    return [1 + len(p.split()) for p in prompts]  # <bos> + words, as the tiny tokenizer counts


def test_batches_are_sorted_by_length_and_cut_at_the_padding_budget():
    from ditfleet.workers.generate import padded_share, plan_batches

    lengths = [40, 12, 13, 12, 41, 90, 12, 40, 13]
    reqs = _requests(lengths, bucket=(64, 64))  # 16 image tokens: padding weighs a lot
    batches = plan_batches(reqs, 4, _word_count, max_padded_share=0.01)
    got = [[len(r.row.prompt.split()) + 1 for r in b] for b in batches]
    # [12 12 12 13] would pad 3 of 184 tokens (1.6%), [40 40 41] pads 2 of 222 (0.9%)
    assert got == [[12, 12, 12], [13, 13], [40, 40, 41], [90]]
    assert plan_batches(reqs, 4) == [reqs[:4], reqs[4:8], reqs[8:]]  # no tokenizer: input order
    loose = plan_batches(reqs, 4, _word_count, max_padded_share=1.0)
    assert [len(b) for b in loose] == [4, 4, 1]
    table = {(r.row.id, 0): (len(r.row.prompt.split()) + 1, 1) for r in reqs}
    assert all(padded_share(b, table) <= 0.01 for b in batches)


@pytest.mark.slow
def test_worker_reports_mask_counts_and_padded_share(random_model_dir, tmp_path):
    """A shard of mixed prompt lengths: no call carries a dense mask, padding stays under 5%."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ditfleet.workers.actor import GenerationWorker
    from tests.support.worker_fixtures import row_config, shard_of, worker_config

    words = ["a red circle", "a red circle", "a small blue square", "a small blue square at the top",
             "a red circle", "a large green triangle on a white background", "a small blue square"]  # fmt: skip
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"id": [f"q{i}" for i in range(len(words))], "prompt": words}), path)
    worker = GenerationWorker(
        worker_config(random_model_dir, str(tmp_path / "out"), rows=row_config(buckets=("32x32",)))
    )
    result = worker.run_shard(shard_of(path, 0, 0, len(words), buckets=("32x32",)), attempt=0)
    a = result.attention
    assert result.images_ok == len(words)
    layers, steps = 2, 2
    # Lengths 4 x3, 5 x2, 7, 8 (with <bos>) at 4 image tokens: batches [4 4 4] [5 5] [7] [8]
    assert a["calls"] == 4 * steps * 2 * layers  # 4 batches, cond + uncond per step
    assert a["masked_calls"] == 0 and a["split_calls"] == 0 and a["padded_tokens"] == 0
    assert a["image_tokens"] == len(words) * steps * 2 * layers * 4
