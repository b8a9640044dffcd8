"""The step cache: reuse of DiT block work between denoising steps, per image and CFG branch.

The pipeline builds a `StepCache` from its settings for each batch (model.generation.pipeline) and the
sampler hands each transformer pass the rows it serves (`StepCache.call`). Each pass makes a
signal for every row of the batch (one image in one CFG branch), then decides per row:

- compute: the row runs the remaining blocks; the residual they add is kept for that row;
- reuse: the row's signal changed little: its output is its input to the remaining blocks plus
  the kept residual (or, with TaylorSeer, the residual extrapolated to this step), and the
  remaining blocks never run for it.

The signal depends on the method (dbcache: the first Fn blocks' residual; teacache: the first
block's modulated input), as model.step_cache_config describes with its sources.

Only the rows that compute go through the remaining blocks (the transformer's `run_blocks` on a
subset of rows, then scattered back), so an image's result and decisions do not depend on its
batch-mates, and the compiled block regions (batch a dynamic dimension) see one more batch size,
not a new graph. The cache calls only the transformer's public `first_block_input` and
`run_blocks`.

Each CFG branch of each image has its own state: the sampler names the branches of each call
(serial CFG: the conditional, then the unconditional; batched CFG: both, conditional rows first).

Forced compute (no decision, no overhead): the warm-up steps, the exact last steps, a row with
nothing cached yet, a row at its limit of consecutive reused steps. A schedule shorter than
`min_steps` runs the transformer untouched (`inactive_reason` says why).
"""

from __future__ import annotations

import torch

from ditfleet.model.qwen_image.transformer import BlockInputs, QwenImageTransformer, take_rows
from ditfleet.model.step_cache_config import StepCacheConfig

# Relative change of a row whose kept signal is all zeros: infinite (compute).
_EPS = 1e-12


class BranchState:
    """What one CFG branch keeps for the images of a batch; the lists hold one entry per image.

    Tensors (B, N, D), rows by image: "signal" (dbcache: at the row's last computed step;
    teacache: at the previous step), "d0" the kept residual and, with TaylorSeer, "d1".. its
    finite-difference derivatives over steps."""

    def __init__(self, batch: int) -> None:
        B = self.batch = batch
        self.tensors: dict[str, torch.Tensor] = {}
        self.has_cache = [False] * B
        self.consecutive = [0] * B  # reused steps in a row
        self.accumulated = [0.0] * B  # teacache: rescaled change since computing
        self.computed_at = [-1] * B  # step of the last computed residual
        self.computes = [0] * B  # computed residuals so far
        self.blocks_computed = [0] * B
        self.blocks_reused = [0] * B
        self.reused_steps: list[list[int]] = [[] for _ in range(B)]  # the steps it reused
        self.changes: list[list[tuple[int, float]]] = [[] for _ in range(B)]  # (step, what was compared)

    def keep(self, name: str, rows: list[int], values: torch.Tensor) -> None:
        """Store `values` (len(rows), N, D) as rows `rows` of tensor `name`."""
        held = self.tensors.get(name)
        if held is None or held.shape[1:] != values.shape[1:] or held.dtype != values.dtype:
            held = self.tensors[name] = values.new_zeros((self.batch, *values.shape[1:]))
        if len(rows) == self.batch:
            held.copy_(values)
        else:
            held.index_copy_(0, torch.tensor(rows, device=values.device), values)

    def take(self, name: str, rows: list[int], like: torch.Tensor | None = None) -> torch.Tensor:
        """Rows `rows` of tensor `name`; zeros shaped as `like`'s rows when nothing was kept yet."""
        held = self.tensors.get(name)
        if held is None:
            assert like is not None, f"step cache: nothing kept as {name!r}"
            return like.new_zeros((len(rows), *like.shape[1:]))
        if len(rows) == self.batch:
            return held
        return held.index_select(0, torch.tensor(rows, device=held.device))


class StepCache:
    """Reuses DiT block work per image and CFG branch (see the module docstring).

    One per batch (its state is that batch's images); `start` resets it.
    """

    def __init__(self, config: StepCacheConfig, num_layers: int) -> None:
        self.config = config
        self.num_layers = num_layers
        self.fn = config.compute_blocks_for(num_layers)
        self.batch = 0
        self.steps = 0
        self.inactive: str | None = None
        self.branches: list[BranchState] = []

    def start(self, steps: int, batch: int) -> None:
        self.steps, self.batch = steps, batch
        self.inactive = self.config.inactive_reason(steps, num_layers=self.num_layers)
        self.branches = []

    def call(self, step: int, branches: tuple[int, ...]) -> StepCacheRows | None:
        """The rows of one transformer call at step `step`: the batch once per CFG branch in
        `branches` (0 conditional, 1 unconditional), in that order. None while inactive."""
        if self.inactive is not None:
            return None
        return StepCacheRows(self, step, [(self._branch(b), self.batch) for b in branches])

    def _branch(self, index: int) -> BranchState:
        while len(self.branches) <= index:
            self.branches.append(BranchState(self.batch))
        return self.branches[index]

    # -- what it did ------------------------------------------------------------------------

    def per_image(self) -> list[dict[str, int]]:
        """Per image of the last run, both CFG branches together: DiT block evaluations computed
        and reused."""
        return [
            {
                "blocks_computed": sum(b.blocks_computed[i] for b in self.branches),
                "blocks_reused": sum(b.blocks_reused[i] for b in self.branches),
            }
            for i in range(self.batch)
        ]

    def reused_steps(self, branch: int, image: int) -> list[int]:
        """The steps at which image `image` of branch `branch` (0 conditional) reused the rest."""
        return list(self.branches[branch].reused_steps[image]) if branch < len(self.branches) else []

    def describe(self) -> str:
        """The settings as recorded, or why this run was exact."""
        if self.inactive is not None:
            return f"off ({self.inactive})"
        return self.config.describe()


class StepCacheRows:
    """One transformer call's rows and the branch state each belongs to; runs the blocks."""

    def __init__(self, cache: StepCache, step: int, segments: list[tuple[BranchState, int]]) -> None:
        self.cache = cache
        self.step = step
        self.segments = segments  # (branch, rows of it), in batch order
        # (branch, image) per batch row
        self.rows = [(branch, i) for branch, count in segments for i in range(count)]

    def _forced(self) -> list[bool]:
        """Rows that compute whatever their signal says."""
        c, steps = self.cache.config, self.cache.steps
        if self.step < c.warmup_steps or self.step >= steps - c.exact_last_steps:
            return [True] * len(self.rows)
        limit = c.max_consecutive_skips
        return [
            not branch.has_cache[i] or (limit >= 0 and branch.consecutive[i] >= limit)
            for branch, i in self.rows
        ]

    def _gather(self, name: str, positions: list[int], like: torch.Tensor | None = None) -> torch.Tensor:
        """Tensor `name` of each branch for batch rows `positions` (in order), concatenated."""
        parts, start = [], 0
        for branch, count in self.segments:
            mine = [p - start for p in positions if start <= p < start + count]
            if mine:
                parts.append(branch.take(name, mine, like))
            start += count
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _scatter(self, name: str, positions: list[int], values: torch.Tensor) -> None:
        start, offset = 0, 0
        for branch, count in self.segments:
            mine = [p - start for p in positions if start <= p < start + count]
            if mine:
                branch.keep(name, mine, values[offset : offset + len(mine)])
                offset += len(mine)
            start += count

    def decide(self, signal: torch.Tensor) -> list[bool]:
        """Per batch row, whether it reuses the rest this call; signal (B, N, D). One host sync
        when any row is a candidate, none otherwise."""
        c = self.cache.config
        forced = self._forced()
        reuse = [False] * len(self.rows)
        candidates = [j for j, f in enumerate(forced) if not f]
        if candidates:
            current = signal if len(candidates) == len(self.rows) else take_rows(signal, candidates)
            kept = self._gather("signal", candidates)
            change = torch.linalg.vector_norm(current - kept, ord=1, dim=(1, 2), dtype=torch.float32)
            scale = torch.linalg.vector_norm(kept, ord=1, dim=(1, 2), dtype=torch.float32)
            relative = (change / scale.clamp_min(_EPS)).tolist()
            for j, r in zip(candidates, relative):
                branch, i = self.rows[j]
                if c.method == "teacache":
                    r = branch.accumulated[i] + _polynomial(c.coefficients, r)
                    branch.accumulated[i] = r
                branch.changes[i].append((self.step, r))
                reuse[j] = r < c.threshold
        if c.method == "teacache":
            for j, (branch, i) in enumerate(self.rows):
                if not reuse[j]:
                    branch.accumulated[i] = 0.0  # computing restarts the sum
            self._scatter("signal", list(range(len(self.rows))), signal)  # every step moves it
        return reuse

    def _remember(self, positions: list[int], residual: torch.Tensor) -> None:
        """Keep the computed rows' residual (len(positions), N, D) and, with TaylorSeer, its
        finite-difference derivatives over steps: d(k+1) = (dk now - dk before) / steps between,
        each only where the row has computed k+1 times before (else 0)."""
        order = self.cache.config.taylorseer_order
        derivatives = [residual]
        if order:
            rows = [self.rows[p] for p in positions]
            between = torch.tensor(
                [float(max(1, self.step - b.computed_at[i])) for b, i in rows], dtype=residual.dtype
            ).to(residual.device)[:, None, None]
            for k in range(order):
                before = self._gather(f"d{k}", positions, like=residual)
                have = torch.tensor([float(b.computes[i] > k) for b, i in rows], dtype=residual.dtype)
                have = have.to(residual.device)[:, None, None]
                derivatives.append((derivatives[k] - before) / between * have)
        for k, d in enumerate(derivatives):
            self._scatter(f"d{k}", positions, d)
        for p in positions:
            branch, i = self.rows[p]
            branch.computed_at[i] = self.step
            branch.computes[i] += 1
            branch.has_cache[i] = True

    def _forecast(self, positions: list[int]) -> torch.Tensor:
        """The reused rows' residual at this step: the kept one, or with TaylorSeer its Taylor
        series sum_k dk (t - t_last)^k / k! over the steps since the row last computed."""
        residual = self._gather("d0", positions)
        order = self.cache.config.taylorseer_order
        if not order:
            return residual
        since = torch.tensor(
            [float(self.step - b.computed_at[i]) for b, i in (self.rows[p] for p in positions)],
            dtype=residual.dtype,
        ).to(residual.device)[:, None, None]
        term = torch.ones_like(since)
        for k in range(1, order + 1):
            term = term * since / k
            residual = residual + self._gather(f"d{k}", positions) * term
        return residual

    def run(
        self, transformer: QwenImageTransformer, img: torch.Tensor, txt: torch.Tensor, inputs: BlockInputs
    ) -> torch.Tensor:
        """The image stream after every block, (B, N, D): the first Fn computed (dbcache), the
        rest computed or reused per row."""
        fn, total = self.cache.fn, self.cache.num_layers
        teacache = self.cache.config.method == "teacache"
        start = None
        if teacache:
            start = transformer.first_block_input(img, inputs)
            signal = start.img_in
        else:
            first = img
            img, txt = transformer.run_blocks(img, txt, inputs, blocks=slice(0, fn))
            signal = img - first  # the first blocks' residual
        reuse = self.decide(signal)
        B = img.shape[0]
        compute = [j for j in range(B) if not reuse[j]]
        skip = [j for j in range(B) if reuse[j]]
        for j in range(B):
            branch, i = self.rows[j]
            branch.blocks_computed[i] += fn if reuse[j] else total
            if reuse[j]:
                branch.blocks_reused[i] += total - fn
                branch.consecutive[i] += 1
                branch.reused_steps[i].append(self.step)
            else:
                branch.consecutive[i] = 0

        out = None
        if compute:
            if not teacache:  # dbcache's reference moves only when computing
                self._scatter("signal", compute, take_rows(signal, compute))
            rest, _ = transformer.run_blocks(
                img, txt, inputs, blocks=slice(fn, None), rows=compute, start=start
            )
            self._remember(compute, rest - take_rows(img, compute))
            if not skip:
                return rest
            out = torch.empty_like(img)
            out.index_copy_(0, torch.tensor(compute, device=img.device), rest)
        reused = take_rows(img, skip) + self._forecast(skip)
        if out is None:
            return reused
        out.index_copy_(0, torch.tensor(skip, device=img.device), reused)
        return out


def _polynomial(coefficients: tuple[float, ...], x: float) -> float:
    """numpy.poly1d(coefficients)(x): highest degree first (Horner)."""
    value = 0.0
    for c in coefficients:
        value = value * x + c
    return value
