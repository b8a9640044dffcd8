"""How much padding the worker's batches carry: the batching plan itself, on 1,000 prompts.

Prompts of 10-300 tokens (counted with the bundled tiny model's tokenizer) are cut into shards
and planned exactly as the worker plans them (`workers.generate.plan_batches`); every DiT
attention call the plan would make is then counted the way the DiT counts it
(`model.qwen_image.attention`): calls with a dense mask, padded calls (run unmasked per text length), and
padded tokens over all tokens computed. No images are generated. The README job's own prompts
(jobs/examples/prompts.parquet) are planned the same way.

    python bench/batch_padding.py
    python bench/batch_padding.py --shard-size 64 --batch-size 8 --bucket 1024x1024
"""

from __future__ import annotations

import argparse
import json
import random

import pyarrow.parquet as pq

from ditfleet.compile.buckets import BucketSet, ResolutionBucket
from ditfleet.model.generation.guidance import DEFAULT_NEGATIVE_PROMPT, negative_text
from ditfleet.model.tiny.text_encoder import WordTokenizer
from ditfleet.workers.generate import image_requests, plan_batches
from ditfleet.workers.rows import PromptRow

TOKENIZER_DIR = "model/tiny/weights/tokenizer"


def make_prompts(n: int, spread: str, rng: random.Random, words: list[str]) -> list[str]:
    """Prompts of 10-300 tokens (<bos> included). 'captions': log-normal lengths (median about
    60 tokens, a long tail), as caption datasets have; 'uniform': every length equally likely."""
    prompts = []
    for _ in range(n):
        if spread == "uniform":
            tokens = rng.randint(10, 300)
        else:
            tokens = min(300, max(10, round(rng.lognormvariate(4.1, 0.6))))
        prompts.append(" ".join(rng.choice(words) for _ in range(tokens - 1)))
    return prompts


def rows_for(prompts: list[str], buckets: list[ResolutionBucket], steps: int) -> list[PromptRow]:
    return [
        PromptRow(
            id=str(i),
            prompt=p,
            negative_prompt=DEFAULT_NEGATIVE_PROMPT,
            seed=i,
            width=b.width,
            height=b.height,
            requested_width=None,
            requested_height=None,
            bucket=b.name,
            steps=steps,
            true_cfg_scale=4.0,
            num_images=1,
            file="bench",
            row=i,
        )  # fmt: skip
        for i, (p, b) in enumerate(zip(prompts, buckets))
    ]


def count_plan(rows: list[PromptRow], shard_size: int, batch_size: int, count, layers: int) -> dict:
    """DiT attention counts of the worker's plan for these rows, shard by shard (one step; every
    step repeats them)."""
    calls = masked = padded_calls = 0
    image_tokens = text_tokens = padded_tokens = 0
    batches = 0
    for start in range(0, len(rows), shard_size):
        for batch in plan_batches(image_requests(rows[start : start + shard_size]), batch_size, count):
            batches += 1
            n = (batch[0].row.width // 16) * (batch[0].row.height // 16)
            for texts in (
                [r.row.prompt for r in batch],
                [negative_text(r.row.negative_prompt) for r in batch],
            ):
                lengths = count(texts)
                longest = max(lengths)
                pad = sum(longest - x for x in lengths)
                calls += layers
                padded_calls += layers if pad else 0
                image_tokens += layers * len(batch) * n
                text_tokens += layers * len(batch) * longest
                padded_tokens += layers * pad
    return {
        "batches": batches,
        "images_per_batch": round(len(rows) / batches, 2),
        "attention_calls_per_step": calls,
        "masked_call_share": round(masked / calls, 4),
        "padded_call_share": round(padded_calls / calls, 4),
        "padded_token_share": round(padded_tokens / (image_tokens + text_tokens), 4),
        "padded_text_share": round(padded_tokens / text_tokens, 4),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=1000)
    ap.add_argument("--shard-size", type=int, default=256, help="rows per shard (the spec's default)")
    ap.add_argument("--batch-size", type=int, default=4, help="the spec's default")
    ap.add_argument("--bucket", default="1328x1328")
    ap.add_argument("--layers", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    tokenizer = WordTokenizer.load(TOKENIZER_DIR)

    def count(texts: list[str]) -> list[int]:
        return [len(tokenizer.tokenize(t, 1024)) for t in texts]

    words = [w for w in tokenizer.vocab if not w.startswith("<")]
    rng = random.Random(args.seed)
    bucket = ResolutionBucket.parse(args.bucket)
    out: dict = {"bench": "batch_padding", "prompts": args.prompts, "shard_size": args.shard_size,
                 "batch_size": args.batch_size, "bucket": args.bucket}  # fmt: skip
    for spread in ("captions", "uniform"):
        prompts = make_prompts(args.prompts, spread, rng, words)
        lengths = count(prompts)
        plan = count_plan(
            rows_for(prompts, [bucket] * len(prompts), 1),
            args.shard_size,
            args.batch_size,
            count,
            args.layers,
        )
        plan["tokens_min_median_max"] = [min(lengths), sorted(lengths)[len(lengths) // 2], max(lengths)]
        out[f"set_{spread}"] = plan
        print(f"1,000 prompts ({spread}, tokens {plan['tokens_min_median_max']}) at {args.bucket}: {plan}")

    table = pq.read_table("jobs/examples/prompts.parquet").to_pydict()
    tiny = BucketSet.from_names(["128x128", "160x96", "96x160"])
    sizes = zip(table["width"], table["height"])
    buckets = [tiny.default() if w is None else tiny.map(w, h) for w, h in sizes]
    readme = count_plan(rows_for(table["prompt"], buckets, 1), 8, 8, count, 4)
    out["readme_job"] = readme
    print(f"README job (tiny.yaml: shards of 8, batch 8): {readme}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
