"""Which SDPA kernel each attention call of the DiT and the VAE takes, recorded as it runs (the
self-test's `sdpa_backends` stage, workers.selftest.checks)."""

from __future__ import annotations

import inspect
import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch.nn.functional as F

from ditfleet.model.generation.attention_backend import sdpa_choice


class SdpaRecorder:
    """Wraps F.scaled_dot_product_attention: per call, the caller (DiT or VAE), the shapes and
    strides it got, and the backend SDPA's own dispatcher picks for them (`torch._fused_sdp_choice`,
    under the preference in force). With `fused_only` on CUDA the math path is disabled, so a call
    no fused kernel takes raises: it is recorded as such, then run on the math path."""

    def __init__(self, fused_only: bool) -> None:
        self.fused_only = fused_only
        self.calls: list[dict[str, Any]] = []

    @contextmanager
    def active(self):
        original = F.scaled_dot_product_attention

        def recorded(q, k, v, attn_mask=None, *args, **kwargs):
            caller = Path(inspect.stack(context=0)[1].filename).name
            site = "vae" if "vae" in caller else "dit" if "attention" in caller else caller
            call = {
                "site": site,
                "q": list(q.shape),
                "kv_len": k.shape[-2],
                "strides": [list(t.stride()) for t in (q, k, v)],
                "last_dim_contiguous": all(t.stride(-1) == 1 for t in (q, k, v)),
                "mask": attn_mask is not None,
                "backend": sdpa_choice(q, k, v, attn_mask),
            }
            try:
                out = original(q, k, v, attn_mask, *args, **kwargs)
            except RuntimeError as e:
                call["backend"] = "none"
                call["error"] = str(e).splitlines()[0][:200]
                from torch.nn.attention import SDPBackend, sdpa_kernel

                with sdpa_kernel([SDPBackend.MATH]):
                    out = original(q, k, v, attn_mask, *args, **kwargs)
            self.calls.append(call)
            return out

        F.scaled_dot_product_attention = recorded
        try:
            if self.fused_only:
                from torch.nn.attention import SDPBackend, sdpa_kernel

                fused = [
                    SDPBackend.FLASH_ATTENTION,
                    SDPBackend.EFFICIENT_ATTENTION,
                    SDPBackend.CUDNN_ATTENTION,
                ]
                with sdpa_kernel(fused):
                    yield self
            else:
                yield self
        finally:
            F.scaled_dot_product_attention = original


def summarize_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The recorded calls grouped by what decides the kernel (site, shapes, mask, backend), counted."""
    groups: dict[str, dict[str, Any]] = {}
    for c in calls:
        key = json.dumps([c["site"], c["q"], c["kv_len"], c["mask"], c["backend"], c["last_dim_contiguous"]])
        if key not in groups:
            groups[key] = {k: c[k] for k in ("site", "q", "kv_len", "mask", "backend", "last_dim_contiguous")}
            groups[key]["calls"] = 0
            if "error" in c:
                groups[key]["error"] = c["error"]
        groups[key]["calls"] += 1
    return list(groups.values())
