"""The batch generator's host syncs and its overlap of the next batch's text encoding.

On the CPU there is no device to wait for, so the proxy counts the calls that block on a GPU:
device-to-host reads (`.cpu()`, `.tolist()`, `.item()`) and event/stream waits made by the batch
generator's own code. At most one per batch (torch.cuda.set_sync_debug_mode counts the real ones
in the node self-test's batch_generator line).
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

import ditfleet.workers.generate as generate
from ditfleet.model.qwen_image.loader import load_pipeline
from ditfleet.workers.generate import BatchGenerator, image_requests, iter_generated, plan_batches
from ditfleet.workers.rows import PromptRow

GENERATE_FILE = str(Path(generate.__file__).resolve())


def rows(n: int) -> list[PromptRow]:
    return [
        PromptRow(
            id=f"p{i}",
            prompt=f"a red circle {i}",
            negative_prompt=None,
            seed=i,
            width=32,
            height=32,
            requested_width=None,
            requested_height=None,
            bucket="32x32",
            steps=2,
            true_cfg_scale=4.0,
            num_images=1,
            file="f",
            row=i,
        )  # fmt: skip
        for i in range(n)
    ]


@pytest.mark.slow
def test_at_most_one_blocking_host_sync_per_batch_and_same_images(monkeypatch):
    import inspect

    pipe = load_pipeline("tiny")
    generator = BatchGenerator(pipe)
    batches = plan_batches(image_requests(rows(6)), 2)
    reference = [g.pixels.clone() for b in batches for g in generator.run(b)]
    counts = {"n": 0}

    def counting(name):
        original = getattr(torch.Tensor, name)

        def wrapped(self, *args, **kwargs):
            caller = inspect.stack(context=0)[1].filename
            if str(Path(caller).resolve()) == GENERATE_FILE:
                counts["n"] += 1
            return original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, wrapped)

    for name in ("cpu", "tolist", "item"):
        counting(name)
    got = [g.pixels for g in iter_generated(generator, batches)]
    assert len(batches) == 3
    assert counts["n"] <= len(batches), counts
    for a, b in zip(got, reference):
        assert torch.equal(a, b)


def test_the_next_batch_is_encoded_while_the_current_one_runs(monkeypatch):
    pipe = load_pipeline("tiny")
    generator = BatchGenerator(pipe)
    batches = plan_batches(image_requests(rows(4)), 2)
    events = []
    real_encode, real_run = generator.encode, generator.run

    def encode(batch):
        events.append(("encode", batch[0].row.id, threading.current_thread().name))
        return real_encode(batch)

    def run(batch, inputs=None):
        assert inputs is not None  # encoded ahead, not inside the run
        events.append(("run", batch[0].row.id, threading.current_thread().name))
        out = real_run(batch, inputs)
        events.append(("run_end", batch[0].row.id, threading.current_thread().name))
        return out

    monkeypatch.setattr(generator, "encode", encode)
    monkeypatch.setattr(generator, "run", run)
    list(iter_generated(generator, batches))
    order = [(kind, rid) for kind, rid, _ in events]
    # the second batch is encoded while the first one runs, not after it
    assert order.index(("encode", "p2")) < order.index(("run_end", "p0"))
    assert all(t.startswith("encode-next") for kind, _, t in events if kind == "encode")


def test_to_host_returns_host_tensors_unchanged():
    a, b = torch.arange(4), torch.ones(2, dtype=torch.bool)
    assert generate.to_host(a, b) == (a, b)


def test_to_host_waits_on_the_streams_of_the_tensors_own_devices():
    # cuda:1's copies are queued on cuda:1's stream, whatever the current device is
    cuda = [torch.device("cuda", 1), torch.device("cpu"), torch.device("cuda", 1), torch.device("cuda", 0)]
    assert generate.copy_devices(cuda) == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert generate.copy_devices([torch.device("cpu")]) == []


def test_the_next_batch_is_encoded_on_its_own_stream_on_cuda_only():
    # on the CPU nothing changes: no stream, the encoding thread's calls are as before
    assert generate.encode_stream(torch.device("cpu")) is None
