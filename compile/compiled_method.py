"""A compiled stand-in for one bound method of one object, e.g. `vae.decode`.

`CompiledMethod(vae, "decode", ...)` compiles the class's function (`type(vae).decode`) and
calls it with the target as `self`. It holds the target only through a weak reference, so it
never keeps an old model alive: installed as an instance attribute (`vae.decode = cm`) it lives
exactly as long as the target. A new target object gets a new CompiledMethod (see
`compiled_method`); Dynamo reuses its compiled graphs for an object of the same structure, so a
replaced VAE is served by the same kernels with the new weights.

Failures, loudly and without crashing the caller:
- the backend fails to compile (or the compiled code fails where eager code works): the target
  falls back to eager for good, with a `CompileFallbackWarning` and `fallback_reason` set;
- Dynamo's recompile limit is hit (more shapes than the warm-up planned for): this call runs
  eager, with a warning, and `limit_hits` counts it;
- an error that eager code raises too (bad input) is raised as eager raises it;
- `torch._dynamo.exc.RecompileError` (a caller asked recompiles to be errors) and out-of-memory
  errors are raised as they are.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch


class CompileFallbackWarning(RuntimeWarning):
    """A compiled target runs eager because compiling it failed (or it needed more shapes)."""


DEFAULT_SHAPE_LIMIT = 8  # Dynamo's own default recompile limit


class CompiledMethod:
    """Callable replacing `getattr(target, name)`; see the module docstring.

    split_batch: when set, the first positional argument (a tensor, batch first) is cut into
    chunks of this many rows (the last one zero-padded) and the results concatenated, so the
    compiled shape never depends on the caller's batch size.
    shape_limit: the recompile limit in force while this target runs (raised from Dynamo's
    default, for this call only, to fit every shape of a warm-up).
    dynamic_dims: {argument position: dims} marked dynamic on every call (e.g. the batch and the
    text length of a DiT block), traced as symbols without specialising sizes 0 and 1
    (`backed_size_oblivious`) or equal sizes to each other, so one graph serves every value.
    An argument that is a tuple is walked: {4: {1: {"cos": (0,)}}} marks dim 0 of
    args[4][1].cos.
    """

    def __init__(
        self,
        target: object,
        name: str,
        compile_kwargs: dict[str, Any],
        label: str = "",
        split_batch: int | None = None,
        shape_limit: int = DEFAULT_SHAPE_LIMIT,
        dynamic_dims: dict[int, Any] | None = None,
    ) -> None:
        function = getattr(type(target), name, None)
        if not callable(function):
            raise TypeError(f"{type(target).__name__} has no method {name!r} to compile")
        if split_batch is not None and split_batch < 1:
            raise ValueError(f"split_batch must be >= 1 or None, got {split_batch}")
        self._target = weakref.ref(target)
        self._function: Callable[..., Any] = function
        self.name = name
        self.label = label or f"{type(target).__name__}.{name}"
        self.compile_kwargs = dict(compile_kwargs)
        self.split_batch = split_batch
        self.shape_limit = shape_limit
        self.dynamic_dims = dynamic_dims
        # torch.compile is lazy: nothing is traced until the first call.
        self._compiled: Callable[..., Any] | None = torch.compile(function, **compile_kwargs)
        self.calls = 0
        self.compiled_calls = 0
        self.limit_hits = 0
        self.fallback_reason: str | None = None

    # -- state ----------------------------------------------------------------------------

    @property
    def target(self) -> object | None:
        """The object this compiles for, or None once it has been garbage-collected."""
        return self._target()

    @property
    def status(self) -> str:
        """'pending' (never run), 'compiled', or 'eager' (fell back; see fallback_reason)."""
        if self.fallback_reason is not None:
            return "eager"
        return "compiled" if self.compiled_calls else "pending"

    def fit_shapes(self, shapes: int) -> None:
        """Make room for at least `shapes` compiled specialisations of this target."""
        self.shape_limit = max(self.shape_limit, int(shapes))

    # -- calling --------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        target = self._target()
        if target is None:
            raise ReferenceError(
                f"compiled {self.label}: its target was garbage-collected; call apply_compile on the "
                "object that replaced it"
            )
        self.calls += 1
        if self.split_batch is not None and args and isinstance(args[0], torch.Tensor):
            return self._split_call(target, args, kwargs)
        return self._call(target, args, kwargs)

    def _split_call(self, target: object, args: tuple, kwargs: dict) -> Any:
        assert self.split_batch is not None
        x, rest = args[0], args[1:]
        n, size = x.shape[0], self.split_batch
        if n == 0:
            return self._call(target, args, kwargs)
        outs = []
        for start in range(0, n, size):
            chunk = x[start : start + size]  # (<= size, ...)
            real = chunk.shape[0]
            if real < size:  # pad, so that the compiled shape is always `size` rows
                chunk = torch.cat([chunk, chunk.new_zeros((size - real, *chunk.shape[1:]))])
            outs.append(self._call(target, (chunk, *rest), kwargs)[:real])
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def _eager(self, target: object, args: tuple, kwargs: dict) -> Any:
        return self._function(target, *args, **kwargs)

    def _call(self, target: object, args: tuple, kwargs: dict) -> Any:
        if self._compiled is None:
            return self._eager(target, args, kwargs)
        from torch._dynamo.exc import FailOnRecompileLimitHit, RecompileError

        cfg = torch._dynamo.config
        previous = cfg.recompile_limit
        raise_limit = previous < self.shape_limit
        if raise_limit:  # scoped to this call: Dynamo reads the limits only while compiling
            previous_total = cfg.accumulated_recompile_limit
            cfg.recompile_limit = self.shape_limit
            # The total over all objects also holds entries of targets since replaced.
            cfg.accumulated_recompile_limit = max(previous_total, 4 * self.shape_limit)
        try:
            if self.dynamic_dims is None:
                out = self._compiled(target, *args, **kwargs)
            else:
                _mark_dynamic(args, self.dynamic_dims)
                with _symbolic_sizes():
                    out = self._compiled(target, *args, **kwargs)
        except (RecompileError, torch.OutOfMemoryError):
            raise
        except FailOnRecompileLimitHit as e:
            self.limit_hits += 1
            warnings.warn(
                CompileFallbackWarning(
                    f"compiled {self.label}: more input shapes than its limit of {self.shape_limit}; "
                    f"this call runs eager ({_first_line(e)}). Warm up every bucket, prompt length and "
                    "batch size the job uses, or raise the shape limit."
                ),
                stacklevel=3,
            )
            return self._eager(target, args, kwargs)
        except Exception as compiled_error:
            # Is it the input (eager fails the same way) or the compiler (eager works)?
            out = self._eager(target, args, kwargs)
            self._fall_back(compiled_error)
            return out
        finally:
            if raise_limit:
                cfg.recompile_limit = previous
                cfg.accumulated_recompile_limit = previous_total
        self.compiled_calls += 1
        return out

    def _fall_back(self, error: BaseException) -> None:
        self.fallback_reason = f"{type(error).__name__}: {_first_line(error)}"
        self._compiled = None  # drop the compiled function and whatever it holds
        warnings.warn(
            CompileFallbackWarning(
                f"compiling {self.label} failed; it runs eager from now on ({self.fallback_reason})"
            ),
            stacklevel=4,
        )

    def __repr__(self) -> str:
        return f"CompiledMethod({self.label}, status={self.status})"


def _mark_dynamic(value: Any, spec: Any) -> None:
    """Mark the dims `spec` names on the tensors inside `value` (see CompiledMethod)."""
    if isinstance(value, torch.Tensor):
        for dim in spec:
            torch._dynamo.mark_dynamic(value, dim)
        return
    for key, sub in spec.items():
        _mark_dynamic(getattr(value, key) if isinstance(key, str) else value[key], sub)


def _symbolic_sizes() -> Any:
    """While tracing: no 0/1 specialisation of dynamic sizes, no equating of equal sizes, so a
    batch of 1 or a one-token prompt runs the same graph as any other."""
    import torch.fx.experimental._config as fx_config

    # install_config_module gives the module `patch` at import; unlike torch's other config
    # modules, this one does not import torch.utils._config_typing, which declares it for mypy.
    return fx_config.patch(backed_size_oblivious=True, use_duck_shape=False)  # type: ignore[attr-defined]


def _first_line(error: BaseException, limit: int = 300) -> str:
    """The first line of an error, followed by its root cause's (Dynamo wraps backend errors)."""
    line = _line(error)
    root = error
    for _ in range(10):  # a chain of causes; Dynamo keeps a backend's error as inner_exception
        cause = getattr(root, "inner_exception", None) or root.__cause__
        if cause is None or cause is root:
            break
        root = cause
    if root is not error:
        line = f"{line} caused by {type(root).__name__}: {_line(root)}"
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _line(error: BaseException) -> str:
    text = [t for t in str(error).strip().splitlines() if t.strip()]
    return text[0].strip() if text else repr(error)


def compiled_method(
    target: object,
    name: str,
    compile_kwargs: dict[str, Any],
    label: str = "",
    split_batch: int | None = None,
    dynamic_dims: dict[int, Any] | None = None,
) -> CompiledMethod:
    """Install (once) and return the CompiledMethod for `target.name`.

    It is stored as an instance attribute, so `target.name(...)` calls it. Called again for the
    same target with the same settings, it returns the installed one (nothing recompiles); with
    other settings it replaces it.
    """
    existing = vars(target).get(name)
    if (
        isinstance(existing, CompiledMethod)
        and existing.target is target
        and existing.compile_kwargs == compile_kwargs
        and existing.split_batch == split_batch
        and existing.dynamic_dims == dynamic_dims
    ):
        return existing
    method = CompiledMethod(
        target, name, compile_kwargs, label=label, split_batch=split_batch, dynamic_dims=dynamic_dims
    )
    # object.__setattr__: an nn.Module's __setattr__ would do the same for a plain callable,
    # but this also works for targets that are not modules.
    object.__setattr__(target, name, method)
    return method


def uninstall(target: object, name: str) -> bool:
    """Remove an installed CompiledMethod, so `target.name` is the plain method again."""
    if isinstance(vars(target).get(name), CompiledMethod):
        delattr(target, name)
        return True
    return False
