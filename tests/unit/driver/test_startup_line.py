"""The progress line while actors compile says how long a bucket's compile takes: about N s on
a machine's first run, seconds from its compile cache after."""

from __future__ import annotations

from ditfleet.compile.claims import BucketClaims
from ditfleet.compile.config import VAE_FIRST_COMPILE_S_CPU, first_compile_estimate_s
from ditfleet.driver.actor_phases import ActorPhase, compiling_detail
from ditfleet.driver.progress import starting_summary


def _compiling(published: dict, in_phase_s: float) -> ActorPhase:
    return ActorPhase("compiling", compiling_detail({"phase": "compiling", **published}), in_phase_s)


def test_a_first_compile_says_about_how_long_and_a_cached_one_says_so():
    first = {"bucket": 1, "buckets": 3, "name": "160x96", "first": True, "estimate_s": 50}
    again = {"bucket": 2, "buckets": 3, "name": "96x160", "first": False, "estimate_s": 50}
    line = starting_summary((_compiling(first, 12.0), _compiling(again, 2.0)))
    assert line == (
        "1 compiling bucket 1/3 (160x96) 12s of about 50 s (first run only), "
        "1 compiling bucket 2/3 (96x160) 2s (from this machine's compile cache)"
    )
    # An actor that publishes no estimate (an older one) keeps the plain line.
    plain = starting_summary((_compiling({"bucket": 1, "buckets": 2, "name": "64x64"}, 3.0),))
    assert plain == "1 compiling bucket 1/2 (64x64) 3s"


def test_a_bucket_is_first_until_a_process_on_the_machine_claimed_it(tmp_path):
    claims = BucketClaims(tmp_path, "key", timeout_s=5)
    assert not claims.compiled_before("160x96")
    fd = claims.try_claim("160x96")
    with claims.hold("160x96", fd):
        pass
    assert claims.compiled_before("160x96") and not claims.compiled_before("96x160")
    assert not BucketClaims(tmp_path, "other key", timeout_s=5).compiled_before("160x96")


def test_the_estimate_is_the_cpu_vae_compile_or_the_gpu_dit_warm_up():
    assert first_compile_estimate_s("cpu", dit=False) == VAE_FIRST_COMPILE_S_CPU == 50
    assert first_compile_estimate_s("cuda", dit=True) == 90
