"""Compile and warm-up: no compile after warm-up, per-target compiled decode, loud fallback,
a fleet-shared compile cache, and prompt padding that changes nothing.

Inductor on CPU takes tens of seconds per graph, so what is about guards and recompiles (the
warm-up, prompt lengths, buckets) runs under Dynamo's "eager" backend, which guards and recompiles
exactly as Inductor would, at no codegen cost. Inductor itself compiles the VAE decode of one
small bucket: its output against eager (test_replaced_vae_...) and its artifacts through the
shared cache (test_a_fresh_actor_...).
"""

from __future__ import annotations

import gc
import threading
import warnings
import weakref

import pytest
import torch

from ditfleet.compile import (
    PROMPT_LENGTH_BUCKETS,
    CacheKey,
    CompileCacheWarning,
    CompileConfig,
    CompileFallbackWarning,
    DirectoryArtifactStore,
    ResolutionBucket,
    WarmupRuns,
    apply_compile,
    cache_key,
    compile_count,
    count_compiles,
    load_shared_cache,
    remove_compile,
    warm_up,
)
from ditfleet.compile.cache import UnauthenticatedCacheBlob, open_sealed, pack, seal, unpack
from ditfleet.compile.claims import CLAIMS_DIR
from ditfleet.model import load_pipeline
from ditfleet.testing.prewarm import spawn_prewarm
from ditfleet.testing.prompt_padding import pad_guidance_inputs
from tests.support.compile_helpers import SMALL_BUCKETS, generate, perturbed_vae, random_embeds, velocity

# (cond tokens, negative tokens): inside, at the edge of, and across prompt-length buckets; each
# pads to a different pair of bucket lengths (16, 32, 64, 128), which is all the compiled code sees.
PROMPT_CASES = ((5, 3), (30, 64), (64, 9), (65, 2), (128, 128))


@pytest.fixture
def warmed(random_model_dir):
    pipe = load_pipeline(random_model_dir)
    report = apply_compile(pipe, CompileConfig(vae=True, dit=True, vae_backend="eager", dit_backend="eager"))
    # The compiled DiT takes any text length: one warm-up per bucket covers every case below.
    warm = warm_up(pipe, SMALL_BUCKETS, WarmupRuns(max_sequence_length=128))
    return pipe, report, warm


@pytest.mark.slow
def test_warmed_buckets_never_compile_again(warmed, random_model_dir):
    pipe, report, warm = warmed
    assert [b.bucket for b in warm.buckets] == ["32x32", "48x32"]
    assert all(b.seconds > 0 and b.runs > 0 for b in warm.buckets)
    assert warm.compiles >= 2, "each bucket compiles at least its VAE decode"
    assert report.fallbacks == {} and set(report.status.values()) == {"compiled"}

    eager = load_pipeline(random_model_dir)
    with torch._dynamo.config.patch(error_on_recompile=True), count_compiles() as tally:
        for bucket in SMALL_BUCKETS:
            for i, (cond_len, neg_len) in enumerate(PROMPT_CASES):
                cond = random_embeds(pipe, 1, cond_len, seed=i)
                neg = random_embeds(pipe, 1, neg_len, seed=100 + i)
                inputs = pad_guidance_inputs(*cond, *neg)
                image = generate(pipe, bucket, inputs)
                assert image.shape == (1, 3, bucket.height, bucket.width)
                if i == 0:  # compiled and eager agree
                    torch.testing.assert_close(image, generate(eager, bucket, inputs), atol=1e-4, rtol=0)
            # A batch of 3 decodes image by image through the same compiled graph.
            z = torch.randn(3, 16, bucket.height // 8, bucket.width // 8)
            with torch.no_grad():  # as the pipeline calls it: grad mode is part of the guards
                torch.testing.assert_close(pipe.vae.decode(z), eager.vae.decode(z), atol=1e-4, rtol=0)
    assert tally.count == 0

    # The modulation cache lives outside the compiled block bodies and still works there:
    # with serial CFG each block computes its modulation once per step, not once per pass.
    calls = []
    hooks = [
        b.img_mod[1].register_forward_hook(lambda *_: calls.append(1))
        for b in pipe.transformer.transformer_blocks
    ]
    try:
        generate(
            pipe,
            SMALL_BUCKETS[0],
            pad_guidance_inputs(*random_embeds(pipe, 1, 5, 1), *random_embeds(pipe, 1, 2, 2)),
        )
    finally:
        for h in hooks:
            h.remove()
    assert len(calls) == 2 * len(pipe.transformer.transformer_blocks)  # 2 steps

    # Prompts longer than any prompt-length bucket need no new graph either.
    long_cond = random_embeds(pipe, 1, 200, seed=5)
    with torch._dynamo.config.patch(error_on_recompile=True), count_compiles() as tally:
        generate(pipe, SMALL_BUCKETS[0], pad_guidance_inputs(*long_cond, *random_embeds(pipe, 1, 2, 6)))
    assert tally.count == 0


@pytest.mark.slow
@torch.no_grad()
def test_replaced_vae_gets_its_own_compiled_decode_and_the_old_one_is_freed(random_model_dir):
    pipe = load_pipeline(random_model_dir)
    config = CompileConfig(vae=True)
    apply_compile(pipe, config)
    z = torch.randn(1, 16, 4, 4)
    first = pipe.vae.decode(z)
    old_vae, old_decode = pipe.vae, vars(pipe.vae)["decode"]
    assert old_decode.status == "compiled"
    assert apply_compile(pipe, config).methods["vae.decode"] is old_decode, "same target: nothing new"

    pipe.vae = perturbed_vae(random_model_dir)
    report = apply_compile(pipe, config)
    new_decode = report.methods["vae.decode"]
    assert new_decode is not old_decode and new_decode.target is pipe.vae
    refs = (weakref.ref(old_vae), weakref.ref(old_decode))
    del old_vae, old_decode
    gc.collect()
    assert [r() for r in refs] == [None, None], "a compiled decode kept the old VAE alive"

    out = pipe.vae.decode(z)
    assert new_decode.status == "compiled"
    torch.testing.assert_close(out, type(pipe.vae).decode(pipe.vae, z), atol=1e-5, rtol=0)
    assert (out - first).abs().max() > 1e-3, "outputs must follow the new weights"

    remove_compile(pipe)
    assert "decode" not in vars(pipe.vae)


def _exploding_backend(gm, example_inputs):
    raise RuntimeError("backend exploded on purpose")


@pytest.mark.slow
def test_a_compile_failure_falls_back_to_eager_loudly(random_model_dir):
    eager = load_pipeline(random_model_dir)
    pipe = load_pipeline(random_model_dir)
    report = apply_compile(pipe, CompileConfig(vae=True, vae_backend=_exploding_backend))
    with pytest.warns(CompileFallbackWarning, match=r"vae\.decode.*exploded on purpose"):
        warm = warm_up(pipe, SMALL_BUCKETS[:1])
    assert "exploded on purpose" in report.fallbacks["vae.decode"]
    assert warm.fallbacks == report.fallbacks
    assert report.to_dict()["status"] == {"vae.decode": "eager"}

    inputs = pad_guidance_inputs(*random_embeds(pipe, 2, 9, seed=1), *random_embeds(pipe, 2, 2, seed=2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once; later calls go straight to eager
        out = generate(pipe, SMALL_BUCKETS[0], inputs, seeds=(1, 2))
    # Not bit-equal: the compiled target decodes image by image (vae_batch=1), eager all at once.
    torch.testing.assert_close(
        out, generate(eager, SMALL_BUCKETS[0], inputs, seeds=(1, 2)), atol=1e-5, rtol=0
    )


@pytest.mark.slow
@torch.no_grad()
def test_bad_input_raises_like_eager_and_is_not_a_compile_failure(random_model_dir):
    pipe = load_pipeline(random_model_dir)
    report = apply_compile(pipe, CompileConfig(vae=True, vae_backend="eager"))
    with pytest.raises(ValueError, match="decode expects"):
        pipe.vae.decode(torch.randn(1, 3, 4, 4))
    assert report.fallbacks == {}
    pipe.vae.decode(torch.randn(1, 16, 4, 4))
    assert report.status == {"vae.decode": "compiled"}


@pytest.mark.slow
def test_padding_to_the_prompt_bucket_changes_no_output(random_model_dir):
    pipe = load_pipeline(random_model_dir)
    bucket = SMALL_BUCKETS[1]
    grid = (bucket.height // 16, bucket.width // 16)
    latents = torch.randn(2, grid[0] * grid[1], 64, generator=torch.Generator().manual_seed(0))
    cond, cond_mask = random_embeds(pipe, 2, 7, seed=1)
    cond_mask[1, 4:] = 0  # two prompts of 7 and 4 tokens in one batch
    neg, neg_mask = random_embeds(pipe, 2, 2, seed=2)
    padded = pad_guidance_inputs(cond, cond_mask, neg, neg_mask)
    assert padded["prompt_embeds"].shape[1] == 16 and padded["negative_prompt_embeds"].shape[1] == 16

    for raw, mask, key in ((cond, cond_mask, "prompt_embeds"), (neg, None, "negative_prompt_embeds")):
        unpadded = velocity(pipe, latents, raw, mask, grid)
        bucketed = velocity(pipe, latents, padded[key], padded[f"{key}_mask"], grid)
        assert (unpadded - bucketed).abs().max().item() <= 1e-5, key

    raw_inputs = {
        "prompt_embeds": cond,
        "prompt_embeds_mask": cond_mask,
        "negative_prompt_embeds": neg,
        "negative_prompt_embeds_mask": neg_mask,
    }
    images = generate(pipe, bucket, raw_inputs, seeds=(3, 4))
    assert (images - generate(pipe, bucket, padded, seeds=(3, 4))).abs().max().item() <= 1e-5


def test_compile_count_counts_dynamo_compiles():
    fn = torch.compile(lambda x: x * 2 + 1, backend="eager")
    before = compile_count()
    fn(torch.ones(3))
    fn(torch.ones(3))
    assert compile_count() - before == 1


def test_compile_count_survives_a_dynamo_reset():
    # torch._dynamo.reset() drops every compile callback; counting must pick up again after it.
    compile_count()
    torch._dynamo.reset()
    fn = torch.compile(lambda x: x - 3, backend="eager")
    before = compile_count()
    fn(torch.ones(2))
    assert compile_count() - before == 1


# ---------------------------------------------------------------------------------------------
# The shared cache


SECRET = b"0123456789abcdef0123456789abcdef"


def _key(name: str = "k.compile-cache") -> CacheKey:
    return CacheKey(name=name, fields=(("what", "test"),))


def test_cache_blob_round_trip_and_every_corruption_is_caught():
    key = _key()
    blob = pack(key, b"mega" * 10, {"ab/cabc.so": b"\x7fELF..", "cd/cdef.main.so": b"lib"})
    assert unpack(key, blob) == (b"mega" * 10, {"ab/cabc.so": b"\x7fELF..", "cd/cdef.main.so": b"lib"})
    flipped = bytearray(blob)
    flipped[-3] ^= 0xFF
    for bad, why in (
        (blob[:-5], "bytes"),
        (bytes(flipped), "SHA-256"),
        (b"junk" + blob, "magic"),
        (pack(_key("other.compile-cache"), b"x", {}), "other.compile-cache"),
    ):
        with pytest.raises(ValueError, match=why):
            unpack(key, bad)


def test_a_corrupt_shared_cache_warns_and_a_missing_one_is_normal(tmp_path):
    store = DirectoryArtifactStore(tmp_path)
    key = _key()
    assert load_shared_cache(store, key, SECRET).status == "missing"
    assert store.put_if_absent(key.name, seal(pack(key, b"m", {})[:-1], SECRET))  # torn before sealing
    with pytest.warns(CompileCacheWarning, match="k.compile-cache"):
        result = load_shared_cache(store, key, SECRET)
    assert result.status == "corrupt" and "bytes" in result.reason


def test_concurrent_writers_one_wins_and_the_blob_is_whole(tmp_path):
    store = DirectoryArtifactStore(tmp_path)
    key = _key()
    blobs = [pack(key, bytes([i]) * 200_000, {}) for i in range(8)]
    results: list[bool] = [False] * 8
    barrier = threading.Barrier(8)

    def write(i: int) -> None:
        barrier.wait()
        results[i] = store.put_if_absent(key.name, blobs[i])

    threads = [threading.Thread(target=write, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(results) == 1
    assert store.get(key.name) == blobs[results.index(True)]
    assert sorted(p.name for p in tmp_path.iterdir()) == [key.name], "no temp files left behind"


def test_cache_key_follows_what_the_compiled_code_depends_on(random_model_dir):
    pipe = load_pipeline(random_model_dir)
    config = CompileConfig()
    key = cache_key(pipe, config, ["32x32", "48x32"])
    assert key == cache_key(pipe, config, ["48x32", "32x32"]), "bucket order does not matter"
    assert key.name != cache_key(pipe, config, ["32x32"]).name
    assert key.name != cache_key(pipe, CompileConfig(dit=True), ["32x32", "48x32"]).name
    assert key.name != cache_key(pipe, config, ["32x32", "48x32"], batch_sizes=(1, 2)).name
    fields = key.describe()
    assert fields["torch"] == torch.__version__ and fields["model"] == pipe.model_revision


@pytest.mark.slow
def test_a_fresh_actor_warms_from_the_shared_cache_without_compiling(random_model_dir, tmp_path):
    """Two fresh processes, each with its own empty local Inductor cache, sharing one store: the
    second compiles no graph with Inductor (every graph comes from the first's blob)."""
    store = tmp_path / "shared"
    env = {
        "OMP_NUM_THREADS": "1",
        "TORCHINDUCTOR_COMPILE_THREADS": "1",
        "DITFLEET_COMPILE_CACHE_KEY": SECRET.decode(),
    }
    buckets = [SMALL_BUCKETS[0].name]
    first = spawn_prewarm(random_model_dir, buckets, store, tmp_path / "inductor-a", extra_env=env)
    second = spawn_prewarm(random_model_dir, buckets, store, tmp_path / "inductor-b", extra_env=env)
    assert (first["load"], first["save"]) == ("missing", "saved")
    assert (second["load"], second["save"]) == ("loaded", "skipped")
    assert second["kernels_loaded"] > 0 and second["key"] == first["key"]
    # Counted, not timed (a loaded machine makes it slower, never wrong): the first compiled its
    # graphs with Inductor, the second found every one in the shared cache.
    assert first["inductor_compiles"] > 0 and second["inductor_compiles"] == 0, (first, second)
    cold = first["load_s"] + first["warmup_s"]
    warm = second["load_s"] + second["warmup_s"]
    print(f"\nwarm-up without shared cache {cold:.1f}s, with it {warm:.1f}s: {cold / warm:.1f}x")


# ---------------------------------------------------------------------------------------------
# Trust: only blobs sealed with the fleet's key are ever unpacked


class _Payload:
    """Unpickling this creates a file: what a planted pickle in the cache would do."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_sealed_blob_opens_only_with_its_key_and_every_byte_is_covered():
    blob = pack(_key(), b"mega", {"ab/cabc.so": b"\x7fELF.."})
    sealed = seal(blob, SECRET)
    assert open_sealed(sealed, SECRET) == blob
    with pytest.raises(UnauthenticatedCacheBlob, match="does not verify"):
        open_sealed(sealed, SECRET[::-1])
    # A flipped bit in the magic makes it look unsealed; anywhere after it, the tag fails.
    for at in (0, len(sealed) // 2, len(sealed) - 1):  # the magic, the tag, the header, the payload
        bad = bytearray(sealed)
        bad[at] ^= 0x01
        with pytest.raises(
            UnauthenticatedCacheBlob, match="no authentication tag" if at == 0 else "does not verify"
        ):
            open_sealed(bytes(bad), SECRET)
    with pytest.raises(UnauthenticatedCacheBlob, match="no authentication tag"):
        open_sealed(blob, SECRET)  # an unsealed blob with a perfectly good header
    with pytest.raises(ValueError, match="at least 16 bytes"):
        seal(blob, b"short")


@pytest.mark.slow
def test_a_forged_blob_writes_nothing_and_the_actor_compiles_normally(
    random_model_dir, tmp_path, monkeypatch
):
    """Someone with write access to the output plants a blob under the actor's key, with a
    header whose SHA-256 they recomputed: a pickle that runs code, and a kernel library."""
    from ditfleet.compile import prepare_worker_pipeline

    inductor = tmp_path / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(inductor))
    pipe = load_pipeline(random_model_dir)
    config = CompileConfig(vae=True, vae_backend="eager")
    # A size no earlier test decodes: Dynamo would reuse that test's graph and compile nothing.
    buckets = [ResolutionBucket(64, 48)]
    key = cache_key(pipe, config, buckets, prompt_lengths=PROMPT_LENGTH_BUCKETS)  # the actor's key
    marker = tmp_path / "payload-ran"
    import pickle

    planted = pack(key, pickle.dumps(_Payload(str(marker))), {"ab/cabcdef.so": b"\x7fELF planted"})
    assert unpack(key, planted)[1], "the forged blob passes every header and checksum test"
    store = DirectoryArtifactStore(tmp_path / "shared")
    for i, forged in enumerate((planted, seal(planted, b"another fleet's key, 32 bytes.."))):
        (tmp_path / "shared" / key.name).unlink(missing_ok=True)
        assert store.put_if_absent(key.name, forged)
        pipe = load_pipeline(random_model_dir)
        with pytest.warns(CompileCacheWarning, match="not trusted"):
            prepared = prepare_worker_pipeline(pipe, config, buckets, store, SECRET, runs=WarmupRuns(steps=1))
        assert prepared.cache_load is not None and prepared.cache_load.status == "unauthenticated", i
        assert not marker.exists(), "the planted pickle was unpickled"
        written = [p for p in inductor.rglob("*") if p.is_file()] if inductor.exists() else []
        # Only the warm-up's empty bucket claim lock (compile.claims) may be there: nothing of the blob.
        written = [p for p in written if not (p.parent.name == CLAIMS_DIR and p.stat().st_size == 0)]
        assert written == [], f"files written into the Inductor cache: {written}"
        assert prepared.fallbacks == {} and prepared.compile.status == {"vae.decode": "compiled"}
        # It warmed up the compiled decode as usual (Dynamo may reuse graphs an earlier test made).
        assert prepared.warmup is not None and all(b.runs > 0 for b in prepared.warmup.buckets)
        # It compiled normally and left the planted blob alone (create-only: it is not replaced).
        assert prepared.cache_save is not None and prepared.cache_save.status in ("exists", "empty")
        assert store.get(key.name) == forged


@pytest.mark.slow
def test_without_a_key_nothing_is_read_from_or_written_to_the_store(random_model_dir, tmp_path):
    from ditfleet.compile import prepare_worker_pipeline

    pipe = load_pipeline(random_model_dir)
    config = CompileConfig(vae=True, vae_backend="eager")
    store = DirectoryArtifactStore(tmp_path / "shared")
    prepared = prepare_worker_pipeline(
        pipe, config, [SMALL_BUCKETS[0]], store, None, runs=WarmupRuns(steps=1)
    )
    assert prepared.cache_load is None and prepared.cache_save is None
    assert not (tmp_path / "shared").exists()
    assert prepared.compile.status == {"vae.decode": "compiled"}
