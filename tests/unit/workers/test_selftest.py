"""The node self-test's CPU smoke run: the same entry point a GPU node runs, at toy widths.

It runs in a child process whose importer refuses ray, pydantic and boto3 (a stock CUDA PyTorch
image has none of them), so an import of any of them anywhere on the self-test's path fails the run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

BLOCKED = ("ray", "pydantic", "boto3", "botocore")

RUNNER = textwrap.dedent(
    """
    import importlib.util
    import sys

    BLOCKED = {blocked!r}

    class Refuse:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"the self-test must not import {{name}}", name=name)
            return None

    # As on a node image without them: a library probing for one (accelerate asks
    # importlib.util.find_spec("boto3")) hears "not installed", and an import of one fails.
    _find_spec = importlib.util.find_spec

    def find_spec(name, package=None):
        if name.split(".")[0] in BLOCKED:
            return None
        return _find_spec(name, package)

    importlib.util.find_spec = find_spec
    sys.meta_path.insert(0, Refuse())
    {extra}
    from ditfleet.workers.selftest.main import run_and_exit
    run_and_exit(sys.argv[1:])
    """
)


def run_selftest(
    out: Path,
    *args: str,
    blocked: tuple[str, ...] = BLOCKED,
    timeout: float = 240,
    extra: str = "",
    tmpdir: Path | None = None,
) -> tuple[int, list[dict]]:
    """The self-test in a child process; `extra`: code run before it (a stage to register);
    `tmpdir`: its TMPDIR (where the default scratch folder goes)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if tmpdir is not None:
        tmpdir.mkdir(parents=True, exist_ok=True)
        env["TMPDIR"] = str(tmpdir)
    code = RUNNER.format(blocked=blocked, extra=extra)
    proc = subprocess.run(
        [sys.executable, "-c", code, "--tiny", "--out", str(out), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    assert lines, f"no JSON lines; stderr:\n{proc.stderr[-3000:]}"
    if proc.returncode < 0:  # killed by a signal after its lines: what it said last tells why
        raise AssertionError(f"self-test died of signal {-proc.returncode}; stderr:\n{proc.stderr[-3000:]}")
    return proc.returncode, lines


def by_stage(lines: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for line in lines:
        out.setdefault(line["stage"], []).append(line)
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tiny_run_prints_every_line_without_ray_pydantic_or_boto3(tmp_path):
    # The diffusers comparisons have their own test below; here the rest of the run.
    out, tmp = tmp_path / "out", tmp_path / "tmp"
    code, lines = run_selftest(out, blocked=BLOCKED + ("diffusers",), tmpdir=tmp)
    stages = by_stage(lines)
    summary = stages["summary"][-1]
    assert code == 0, summary
    assert summary["status"] == "pass" and not summary["error"], summary
    # every line went to the log folder too, in the order printed (the compile-heavy stages'
    # children's lines included, once each)
    kept = [json.loads(x) for x in (out / "selftest.jsonl").read_text().splitlines()]
    assert kept == lines
    assert (out / "selftest.log").stat().st_size > 0
    # --out holds the two files only; the scratch folder (shards, the shard, caches) is gone
    assert sorted(p.name for p in out.iterdir()) == ["selftest.jsonl", "selftest.log"]
    assert list(tmp.iterdir()) == []
    # the hub layout was written as shards + index and loaded
    load = [x for x in stages["correctness"] if x.get("check") == "hub_layout_load"][0]
    assert load["status"] == "pass" and load["files"] >= 3
    # without diffusers the side-by-side checks say why they did not run
    assert any(x["status"] == "skipped" and "diffusers" in x["reason"] for x in stages["correctness"])
    # every SDPA call of a step is reported with its backend, DiT and VAE; the VAE's q/k/v dense
    sdpa = stages["sdpa_backends"][-1]
    sites = {c["site"] for c in sdpa["by_call"]}
    assert sites == {"dit", "vae"}
    # the DiT's q/k/v are dense; the VAE's are dense on CUDA only (CPU images stay byte-identical)
    assert all(c["last_dim_contiguous"] for c in sdpa["by_call"] if c["site"] == "dit")
    assert all(c["backend"] in ("flash", "efficient", "cudnn", "math") for c in sdpa["by_call"])
    recompiles = [x for x in stages["compile"] if x.get("check") == "recompiles"][0]
    assert recompiles["status"] == "pass" and recompiles["recompiles"] == 0
    for name in ("dit_eager", "dit_compiled", "cfg_step", "vae_decode", "images_per_hour", "batch_generator"):
        assert name in stages, name
        assert stages[name][-1]["status"] == "measured", stages[name]
    assert set(stages["cfg_step"][-1]["ms_per_cfg_step"]) == {"off", "cfg", "table"}
    assert stages["batch_generator"][-1]["stored"] == 2
    # the vqa line: a probability, the same on each call, timed next to the CFG step
    vqa = stages["vqa"][-1]
    assert vqa["status"] == "measured" and vqa["score_in_0_1"] and vqa["same_score_each_call"], vqa
    assert vqa["ms_per_image"] > 0 and vqa["vqa_per_cfg_step"] > 0
    # the step cache's line: each preset against exact on the same image (random weights: the
    # work counts and the wall time are the figures, not the distance)
    cached = stages["step_cache"][-1]
    assert cached["status"] == "measured" and set(cached["presets"]) == {"safe", "fast"}, cached
    assert all(p["active"] and p["work_speedup"] >= 1 for p in cached["presets"].values())
    # the FP8 line: both modes run on the CPU (peak memory is a CUDA measurement, None here)
    assert stages["fp8_forward"][-1]["status"] in ("skipped", "measured")
    fp8 = {x["mode"]: x for x in stages["fp8_forward"] if x["status"] == "measured"}
    assert set(fp8) == {"fp8", "fp8-weight-only"}, stages["fp8_forward"]
    assert all(x["ms_per_forward"] > 0 and x["rel_err_vs_bf16"] < 0.2 for x in fp8.values())
    assert all("forward_peak_gb" in x and x["weights_gb"] >= 0 for x in fp8.values())
    # how its GEMMs ran: the kernel probed (rowwise, or tensorwise on a per-tensor-only build)
    assert set(fp8["fp8"]["gemm_scales"]) <= {"rowwise", "tensorwise", "weight-only"}
    assert set(fp8["fp8-weight-only"]["gemm_scales"]) == {"weight-only"}
    # the compiled DiT line is the main size only; the other size has its own stage
    assert [x["size"] for x in stages["dit_compiled"]] == ["64x64"]
    assert [x["size"] for x in stages["dit_compiled_other_sizes"]] == ["96x96"]
    # its child was handed the numbers its line compares with (the eager ms, the matmul ceiling)
    other = stages["dit_compiled_other_sizes"][-1]
    assert other["speedup_vs_eager"] > 0 and other["pct_of_matmul_ceiling"] is not None, other
    # the CUDA-only lines say so on the CPU; the optional compiled-FP8 stage is not run unasked
    assert (
        stages["sdpa_speed"][-1]["status"] == "skipped" and "not on CPU" in stages["sdpa_speed"][-1]["reason"]
    )
    assert "fp8_compiled" not in stages


@pytest.mark.slow
def test_a_stage_out_of_time_says_so_and_the_rest_are_skipped_with_a_line(tmp_path):
    code, lines = run_selftest(
        tmp_path,
        "--only",
        "env,matmul_ceiling,dit_eager,cfg_step",
        "--budget-s",
        "0.5",
        "--limit-scale",
        "0.01",
        timeout=120,
    )
    stages = by_stage(lines)
    assert {"env", "dit_eager", "cfg_step", "summary"} <= set(stages)
    assert any(x["status"] in ("deadline", "skipped") for x in stages["dit_eager"] + stages["cfg_step"])
    assert lines[-1]["stage"] == "summary"


@pytest.mark.slow
def test_tiny_run_matches_diffusers(tmp_path):
    pytest.importorskip("diffusers")
    code, lines = run_selftest(tmp_path, "--only", "env,correctness")
    checks = {x.get("check"): x for x in by_stage(lines)["correctness"]}
    for name in ("dit_vs_diffusers", "vae_vs_diffusers", "timestep_trajectory"):
        assert checks[name]["status"] == "pass", checks[name]
    assert checks["dit_vs_diffusers"]["rel_err"] < 0.01
    assert code == 0


HANG = """
import os, time
from ditfleet.workers.selftest import stages  # noqa: F401
from ditfleet.workers.selftest.runner import stage

@stage("hang", estimate_s=0, limit_s=2, isolated=True, after="env")
def hang(ctx):
    \"\"\"A compile that never returns.\"\"\"
    (ctx.scratch / "hang.pid").write_text(str(os.getpid()))
    time.sleep(600)
"""


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_an_isolated_stage_past_its_deadline_ends_with_a_timeout_line_and_the_rest_run(tmp_path):
    scratch = tmp_path / "scratch"
    code, lines = run_selftest(
        tmp_path / "out",
        "--only",
        "env,hang,matmul_ceiling",
        "--scratch",
        str(scratch),
        "--keep-scratch",
        extra=HANG,
        timeout=150,
    )
    stages = by_stage(lines)
    assert [x["status"] for x in stages["hang"]] == ["timeout"], stages["hang"]
    assert "ended" in stages["hang"][0]["reason"]
    assert stages["matmul_ceiling"][-1]["status"] == "measured"  # after it, still run
    summary = lines[-1]
    assert summary["stage"] == "summary" and summary["timeout"] == ["hang"]
    assert summary["status"] == "pass" and code == 0  # a speed stage's timeout: a missing number
    pid = int((scratch / "hang.pid").read_text())  # the child is gone, not left running
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_the_stage_estimates_fit_the_budget_with_margin():
    from ditfleet.workers.selftest import stages  # noqa: F401 - registers the stages
    from ditfleet.workers.selftest.main import BUDGET_S, ESTIMATE_MARGIN
    from ditfleet.workers.selftest.runner import STAGES

    planned = [s for s in STAGES if not s.optional]  # what a plain run runs
    total = sum(s.estimate_s for s in planned)
    assert total <= BUDGET_S * (1 - ESTIMATE_MARGIN), {s.name: s.estimate_s for s in planned}
    assert all(s.limit_s >= s.estimate_s for s in STAGES)
    # the stages that compile from scratch run where their deadline can end them
    assert {s.name for s in STAGES if s.isolated} == {"compile", "dit_compiled_other_sizes", "fp8_compiled"}
    assert {s.name for s in STAGES if s.optional} == {"fp8_compiled", "cfg_modes"}


def _tiny_context(out: Path, *options: str, **fields):
    """A `--tiny` run's Context in this process (CPU, 600 s of budget and stage deadline)."""
    import time

    import torch

    from ditfleet.workers.selftest.main import build_parser
    from ditfleet.workers.selftest.runner import Context

    args = build_parser().parse_args(["--tiny", "--out", str(out), *options])
    now = time.perf_counter()
    return Context(
        args=args, out=out, device=torch.device("cpu"), dtype=torch.bfloat16, tiny=True, started=now,
        budget_s=600, stage_deadline=now + 600, **fields,
    )  # fmt: skip


@pytest.mark.slow
def test_dit_compiled_keeps_the_compiled_vae_and_compiles_the_main_size_only(tmp_path):
    from ditfleet.compile.policy import apply_compile
    from ditfleet.workers.selftest import compile_check, parts, speed
    from ditfleet.workers.selftest.runner import StageSkipped

    ctx = _tiny_context(tmp_path, "--layers", "2", "--text-len", "8", scratch=tmp_path / "scratch")
    ctx.args.repeat = 1
    # as the compile stage leaves it on a GPU: its settings, the VAE decode compiled
    config = compile_check.compile_config(ctx, dit=True, vae=True)
    vae = parts.make_vae(ctx)
    dit = parts.make_transformer(parts.transformer_config(ctx, 1), ctx.device, ctx.dtype)
    apply_compile(speed.pipeline_to_compile(dit, vae), config)
    decode = speed.compiled_decode(vae)
    assert decode is not None
    ctx.state.update(vae=vae, compile_config=config, compile_passed=True)
    ctx.current = "dit_compiled"
    speed.dit_compiled(ctx)
    assert speed.compiled_decode(vae) is decode  # still installed, the same compiled target
    assert [line["size"] for line in ctx.lines] == ["64x64"]
    assert ctx.lines[0]["status"] == "measured" and ctx.lines[0]["fallbacks"] == {}
    # a compile stage that did not finish: no fresh, unstoppable compile here
    ctx.lines.clear()
    ctx.state["compile_passed"] = False
    with pytest.raises(StageSkipped, match="compile stage did not finish"):
        speed.dit_compiled(ctx)


def test_an_isolated_stage_whose_child_dies_while_starting_is_an_error_at_once(tmp_path):
    """A child that exits before it starts its stage ends the wait for its start (CHILD_START_S)
    at once: an error line, not a `timeout` one after the start-up allowance."""
    from ditfleet.workers.selftest import stages  # noqa: F401 - registers the stages
    from ditfleet.workers.selftest.runner import STAGES, run_isolated

    ctx = _tiny_context(tmp_path, child_command=[sys.executable, "-c", "import sys; sys.exit(3)"])
    run_isolated(ctx, next(s for s in STAGES if s.isolated))
    (line,) = ctx.lines
    assert line["status"] == "error" and "exited with 3 without a line" in line["error"], line


@pytest.mark.slow
def test_cfg_modes_rehearsal_measures_each_mode_and_serial_against_batched(tmp_path):
    """--extra cfg_modes on the CPU: per size, a step without CFG per modulation-cache mode and
    a CFG step serial against batched at batch 1 and 4, each with the faster one named."""
    code, lines = run_selftest(tmp_path / "out", "--only", "cfg_modes", "--extra", "cfg_modes", timeout=200)
    got = [x for x in lines if x["stage"] == "cfg_modes"]
    assert code == 0 and [x["size"] for x in got] == ["64x64", "96x96"], lines
    for x in got:
        assert x["status"] == "measured" and set(x["ms_per_step_without_cfg"]) == {"off", "cfg", "table"}
        for batch in ("1", "4"):
            m = x["cfg_serial_vs_batched_ms"][batch]
            assert m["serial"] > 0 and m["batched"] > 0
            assert m["faster"] == ("batched" if m["batched"] < m["serial"] else "serial")
    # the same times as the table a job's sampling.cfg_table reads (model.cfg_table)
    from ditfleet.model.cfg_table import read_cfg_table

    table = read_cfg_table(tmp_path / "out" / "cfg_table.json")
    assert got[-1]["cfg_table"] == str(tmp_path / "out" / "cfg_table.json") and table.device == "cpu"
    assert {(e.width, e.batch): (e.serial_ms, e.batched_ms) for e in table.entries} == {
        (int(x["size"].split("x")[0]), int(b)): (m["serial"], m["batched"])
        for x in got
        for b, m in x["cfg_serial_vs_batched_ms"].items()
    }


def test_the_published_widths_and_the_forward_cost_come_from_the_family(tmp_path):
    """The self-test asks the family: its configs at the published widths, its FLOPs per forward."""
    import dataclasses

    from ditfleet.model.qwen_image.transformer_config import TransformerConfig
    from ditfleet.workers.selftest import parts

    ctx = dataclasses.replace(_tiny_context(tmp_path), tiny=False)
    config = parts.transformer_config(ctx, 2)
    published = parts.FAMILY.published_config("transformer/config.json")
    assert config == TransformerConfig.from_dict({**published, "num_layers": 2})
    assert published["num_layers"] == 60 and config.inner_dim == 3072
    assert parts.config_file(ctx, "vae/config.json") == parts.FAMILY.published_config("vae/config.json")
    assert parts.forward_flops(config, 1024, 64) == parts.FAMILY.forward_flops(
        config.to_dict(), 1024, 1024, 64
    )
    # 2 blocks at 1024x1024 with 64 text tokens (4,160 tokens): about 2.3 TFLOP
    assert 2.2e12 < parts.forward_flops(config, 1024, 64) < 2.4e12


def test_the_self_test_builds_the_family_model_at_toy_and_published_widths(tmp_path):
    """The self-test's random models are the family's (empty_transformer / empty_vae on the run's
    configs): --tiny at the family's toy widths (the sizes the self-test had as its own constants),
    and the DiT's text width and attention shape come from the family, not from the DiT's fields."""

    import torch

    from ditfleet.workers.selftest import parts, vqa

    ctx = _tiny_context(tmp_path)
    toy = parts.FAMILY.toy_config("transformer/config.json", 3)
    assert {k: toy[k] for k in ("num_layers", "num_attention_heads", "attention_head_dim")} == {
        "num_layers": 3,
        "num_attention_heads": 2,
        "attention_head_dim": 32,
    }
    assert parts.transformer_config(ctx, 3).to_dict() == toy
    assert parts.config_file(ctx, "vae/config.json") == parts.FAMILY.toy_config("vae/config.json")
    dit = parts.make_transformer(parts.transformer_config(ctx, 1), ctx.device, ctx.dtype)
    assert type(dit) is type(parts.FAMILY.empty_transformer(toy))
    assert not any(p.is_meta for p in dit.parameters())
    assert parts.FAMILY.text_width(toy) == 32 and parts.FAMILY.attention_shape(toy) == (2, 32)
    x, txt, shapes = parts.dit_inputs(parts.transformer_config(ctx, 1), 64, 5, 2, ctx.device, ctx.dtype)
    assert tuple(txt.shape) == (2, 5, 32)
    with torch.no_grad():
        assert dit(x, txt, None, torch.full((1,), 0.5, dtype=ctx.dtype), shapes).shape == x.shape
    vae = parts.make_vae(ctx)
    assert type(vae) is type(parts.FAMILY.empty_vae(parts.FAMILY.toy_config("vae/config.json"), False))
    # a config the family has no toy widths for is refused, naming the ones it has
    with pytest.raises(KeyError, match="scheduler.*no toy config"):
        parts.FAMILY.toy_config("scheduler/scheduler_config.json")
    assert vqa.encoder_config(tiny=True)["text_config"]["hidden_size"] == 32
    assert vqa.encoder_config(tiny=True) is not vqa.encoder_config(tiny=True)  # a fresh copy each time


def test_the_dit_eager_line_times_fused_qkv_against_three_gemms(tmp_path):
    """Issue 50, lever 5 on the GPU: the first size's dit_eager line times the DiT with q/k/v as
    three GEMMs (the image stream's) next to the fused GEMM the loader sets up (rehearsed on the CPU)."""
    code, lines = run_selftest(tmp_path / "out", "--only", "dit_eager", timeout=200)
    got = [x for x in lines if x["stage"] == "dit_eager" and x["status"] == "measured"]
    assert code == 0 and got, lines
    qkv = got[0]["projections"]
    assert qkv["fused_ms"] > 0 and qkv["three_gemms_ms"] > 0 and qkv["bit_identical"] is True
    assert qkv["fused_speedup"] == round(qkv["three_gemms_ms"] / qkv["fused_ms"], 3)
    assert all("projections" not in x for x in got[1:])
