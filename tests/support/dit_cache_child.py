"""One actor in a fresh process: start-up through the shared compile cache with the DiT compiled,
then requests over several prompt lengths and batch sizes.

    python -m tests.support.dit_cache_child '<json>'

The JSON gives `model`, `buckets` (names), `store` (directory), `cfg_mode`, `cases`
([batch, text length] pairs run after start-up under error_on_recompile; with batch > 1
the first prompt is half padding) and `images` (a
path: the images of every case are saved there with torch.save). The fleet's key comes from
DITFLEET_COMPILE_CACHE_KEY and the local Inductor cache from TORCHINDUCTOR_CACHE_DIR, as for an
actor. Prints one JSON line: what start-up loaded and saved, the Inductor graph cache hits and
misses of the warm-up, how many kernel libraries the C++ compiler built during start-up and
during requests, and the Dynamo compiles of the requests.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter

import torch


def _count_cpp_builds() -> Counter:
    """Count the runs of Inductor's C++ compiler in this process (CppBuilder.build): "kernels"
    those that build a kernel library (.so), "other" the rest (the per-node preprocessing and
    precompilation of Inductor's C++ prefix header, outside the per-graph caches)."""
    from torch._inductor import cpp_builder

    runs: Counter = Counter()
    build = cpp_builder.CppBuilder.build

    def counted(self, *args, **kwargs):
        runs["kernels" if self.get_target_file_path().endswith(".so") else "other"] += 1
        return build(self, *args, **kwargs)

    cpp_builder.CppBuilder.build = counted
    return runs


def main(args: dict) -> dict:
    from torch._dynamo.utils import counters

    from ditfleet.compile import (
        CompileConfig,
        DirectoryArtifactStore,
        ResolutionBucket,
        WarmupRuns,
        count_compiles,
        prepare_worker_pipeline,
    )
    from ditfleet.model import load_pipeline
    from tests.support.compile_helpers import generate, random_embeds

    cpp = _count_cpp_builds()
    pipe = load_pipeline(args["model"], load_text_encoder_too=False, cfg_mode=args["cfg_mode"])
    secret = os.environ["DITFLEET_COMPILE_CACHE_KEY"].encode()
    config = CompileConfig(vae=False, dit=True)
    prepared = prepare_worker_pipeline(
        pipe, config, args["buckets"], DirectoryArtifactStore(args["store"]), secret, runs=WarmupRuns(steps=1)
    )
    inductor = dict(counters["inductor"])
    startup_kernels = cpp["kernels"]
    images = {}
    with torch._dynamo.config.patch(error_on_recompile=True), count_compiles() as requests:
        for bucket in prepared.warmup.buckets if prepared.warmup else ():
            size = ResolutionBucket.parse(bucket.bucket)
            for batch, length in args["cases"]:
                embeds, mask = random_embeds(pipe, batch, length, seed=length)
                if batch > 1 and length > 1:
                    mask[0, length // 2 :] = 0  # one shorter prompt: the split attention path
                neg, neg_mask = random_embeds(pipe, batch, 1, seed=length + 1)
                inputs = {
                    "prompt_embeds": embeds,
                    "prompt_embeds_mask": mask,
                    "negative_prompt_embeds": neg,
                    "negative_prompt_embeds_mask": neg_mask,
                }
                images[f"{bucket.bucket}/{batch}x{length}"] = generate(
                    pipe, size, inputs, seeds=range(batch), steps=2
                )
    torch.save(images, args["images"])
    return {
        "load": prepared.cache_load.status if prepared.cache_load else "off",
        "kernels_loaded": prepared.cache_load.kernels if prepared.cache_load else 0,
        "save": prepared.cache_save.status if prepared.cache_save else "skipped",
        "save_kernels": prepared.cache_save.kernels if prepared.cache_save else 0,
        "key": (prepared.cache_load or prepared.cache_save).key,
        "status": prepared.compile.status,
        "warmup_compiles": prepared.warmup.compiles if prepared.warmup else 0,
        "fxgraph_hit": inductor.get("fxgraph_cache_hit", 0),
        "fxgraph_miss": inductor.get("fxgraph_cache_miss", 0),
        "fxgraph_bypass": inductor.get("fxgraph_cache_bypass", 0),
        "startup_kernel_builds": startup_kernels,
        "request_kernel_builds": cpp["kernels"] - startup_kernels,
        "header_builds": cpp["other"],
        "request_compiles": requests.count,
        "startup_s": round(prepared.seconds, 2),
    }


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1])), sort_keys=True))
