"""The layer direction of ARCHITECTURE.md, read from the source: model <- compile <- workers <- driver <- jobs.

Every module of the five packages is parsed with `ast` (nothing is imported). A test fails on:
- an upward import (model importing compile, compile importing workers, ...), wherever it is
  written: at module level, under `if TYPE_CHECKING:` or inside a function (a lazy import is
  still a dependency);
- an import in model/ of anything but torch, safetensors, the standard library and model itself;
- an import inside model/ against model/'s own order (MODEL_ORDER: settings, loading, the
  families' networks, the shared machinery, the families' faces, the face's table);
- an import cycle between our modules. Only imports that run when a module is loaded count
  here: module level, including `try`/`if` blocks, but not `if TYPE_CHECKING:` and not imports
  inside functions or methods (they run after both modules are loaded, so they cannot meet a
  partially initialised module).
- a cycle that a function-level import closes and that is not in DEFERRED_CYCLES: such an import
  hides a two-way dependency rather than removing it, so each one is listed on purpose.
- an import across the repository's other folders that their rooms do not allow: recipes/ import
  only ditfleet.model (and themselves); bench/ never imports tests/; nothing installed (the layers,
  ditfleet/) imports recipes/, bench/ or tests/, which are not installed.
Each failure names the file and line.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.paths import REPO

ROOT = REPO
LAYERS = ("model", "compile", "workers", "driver", "jobs")  # each may import only those before it
PACKAGE = "ditfleet"  # the layers install as ditfleet.<layer> (setup.py)
MODEL_MAY_IMPORT = {"torch", "safetensors", "model"}
# (file, package) that model/ imports beyond those, each inside the function that needs it.
MODEL_OPTIONAL_IMPORTS = {
    # The published Qwen2.5-VL text encoder is transformers' model (the `qwen` extra); the
    # tiny model's own text encoder needs nothing.
    ("model/qwen_image/text_encoder.py", "transformers"),
    # The clip scorer loads transformers' CLIPModel (quality.clip_model), only when asked for.
    ("model/quality/clip_score.py", "transformers"),
    # A checkpoint without a native family runs through diffusers' own pipeline class (the
    # `diffusers` extra), imported only where such a checkpoint is loaded.
    ("model/diffusers_pipeline/loader.py", "diffusers"),
    # The self-test checks the Qwen-Image DiT against diffusers' on the same weights
    # (QwenImageFamily.reference_transformer), only when that check runs.
    ("model/qwen_image/family.py", "diffusers"),
    # An edit model's sources are PIL images (Pillow is a core dependency): resized with
    # diffusers' Lanczos, only where sources are encoded.
    ("model/qwen_image/edit_sources.py", "PIL"),
}

# The repository's folders besides the layers (the layers are what `LAYERS` checks):
# folder -> the first parts of the modules of ours (ditfleet.<layer>, recipes, bench, tests) it may
# import. ditfleet/ is the installed face and ditfleet.testing the builders both bench/ and tests/ use.
REPO_FOLDERS = {
    PACKAGE: {PACKAGE},
    "recipes": {f"{PACKAGE}.model", "recipes"},
    "bench": {PACKAGE, "recipes", "bench"},
    "tests": {PACKAGE, "recipes", "tests"},
}
NOT_INSTALLED = ("recipes", "bench", "tests")

# Two-way dependencies whose second direction is a function-level import. None is a module-level
# cycle (that would fail outright); each would be listed here so that a new one is a decision, and
# the test fails when a listed one is gone (then delete its line). There are none.
DEFERRED_CYCLES: set[frozenset[str]] = {
    # The diffusers family's face is torch-free (the driver reads it); its load_pipeline imports
    # the torch side, which names the family it loaded.
    frozenset({"ditfleet.model.diffusers_pipeline.family", "ditfleet.model.diffusers_pipeline.loader"}),
}


# model/'s own order, lowest first: a module imports only modules of its own unit or of a unit
# before it (function-level and TYPE_CHECKING imports too). A unit is a sub-folder or a top-level
# module of model/. A family folder (one with a family.py) is two units: its networks, LoRA key
# map, FP8 and memory formula below the shared machinery (memory plan, sampling loop, scorers),
# its face and assembly (FAMILY_FACE) above it, where the face's table (model/family.py) reads them.
MODEL_ORDER: tuple[tuple[str, ...], ...] = (
    ("lazy_exports", "family_types", "knobs", "step_cache_config"),
    ("settings",),
    ("loading",),
    ("tiny",),
    ("<family>",),
    ("memory",),
    ("generation",),
    ("quality",),
    ("<family face>",),
    ("family",),
    ("__init__",),
)
FAMILY_FACE = ("family", "loader")


def family_folders() -> set[str]:
    return {p.parent.name for p in (ROOT / "model").glob("*/family.py")}


def model_unit(module: str) -> str:
    """The unit of MODEL_ORDER a module of model/ belongs to ("generation", "<family>", ...)."""
    rest = module.split(".")[2:]
    if not rest:
        return "__init__"
    if rest[0] in family_folders():
        return "<family face>" if len(rest) > 1 and rest[1] in FAMILY_FACE else "<family>"
    return rest[0]


def model_rank(module: str) -> int:
    unit = model_unit(module)
    ranks = [i for i, units in enumerate(MODEL_ORDER) if unit in units]
    assert ranks, (
        f"{module}: its unit {unit!r} has no place in MODEL_ORDER (tests/unit/test_layering.py); add it"
    )
    return ranks[0]


@dataclass(frozen=True)
class Import:
    source: str  # the importing module, e.g. "ditfleet.driver.plan"
    target: str  # the imported module of ours, e.g. "ditfleet.workers.rows" (a package: its __init__)
    where: str  # "driver/plan.py:31"
    at_load: bool  # runs when `source` is loaded (module level, not TYPE_CHECKING)


def module_name(path: Path) -> str:
    """The import name of one of our files: model/qwen_image/loader.py is ditfleet.model.qwen_image.loader."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join((PACKAGE, *(parts[:-1] if parts[-1] == "__init__" else parts)))


def top_name(module: str) -> str:
    """What an import is of: our layer ("model" for ditfleet.model.x), else its top-level package."""
    parts = module.split(".")
    return parts[1] if parts[0] == PACKAGE and len(parts) > 1 else parts[0]


def our_modules() -> dict[str, Path]:
    return {module_name(p): p for layer in LAYERS for p in sorted((ROOT / layer).rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.Module) -> list[tuple[ast.Import | ast.ImportFrom, bool]]:
    """(import statement, runs at load) for every import in the module."""
    found: list[tuple[ast.Import | ast.ImportFrom, bool]] = []

    def visit(node: ast.AST, at_load: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append((child, at_load))
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, False)
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    visit(ast.Module(body=[stmt], type_ignores=[]), False)
                for stmt in child.orelse:
                    visit(ast.Module(body=[stmt], type_ignores=[]), at_load)
            else:
                visit(child, at_load)

    visit(tree, True)
    return found


def _absolute(node: ast.ImportFrom, source: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = source.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def all_imports() -> tuple[list[Import], list[tuple[str, str]]]:
    """Our imports between our modules, and (where, top-level name) of every import at all."""
    modules = our_modules()
    ours: list[Import] = []
    every: list[tuple[str, str]] = []
    for source, path in modules.items():
        rel = path.relative_to(ROOT).as_posix()
        tree = ast.parse(path.read_text(), filename=rel)
        for node, at_load in _imports(tree):
            where = f"{rel}:{node.lineno}"
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = _absolute(node, source, path.name == "__init__.py")
                # `from pkg import name`: the submodule pkg.name when there is one, else pkg itself.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for target in targets:
                every.append((where, top_name(target)))
                if target.split(".")[0] == PACKAGE and top_name(target) in LAYERS:
                    # `import a.b.c` of a module we do not have: the nearest package that exists.
                    while target not in modules and "." in target:
                        target = target.rsplit(".", 1)[0]
                    if target != source:
                        ours.append(Import(source, target, where, at_load))
    return ours, every


def _layer(module: str) -> int:
    return LAYERS.index(top_name(module))


def cycles(edges: list[Import]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.source, set()).add(e.target)
        graph.setdefault(e.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return sorted(found)


@pytest.mark.slow
def test_the_parser_sees_every_layer_and_its_imports():
    modules = our_modules()
    assert {top_name(m) for m in modules} == set(LAYERS)
    edges, _ = all_imports()
    # A few imports that the code is known to make, so that a parser that finds nothing fails.
    seen = {(e.source, e.target) for e in edges}
    assert ("ditfleet.driver.plan", "ditfleet.workers.rows") in seen
    assert (
        "ditfleet.workers.actor",
        "ditfleet.workers.contract",
    ) in seen  # relative: `from .contract import ...`
    assert ("ditfleet.jobs.cli", "ditfleet.driver.run_job") in seen


def test_no_upward_import():
    edges, _ = all_imports()
    upward = [
        f"{e.where}: {e.source} imports {e.target} (of our packages, {top_name(e.source)} may import "
        f"{', '.join(LAYERS[: _layer(e.source)]) or 'none'})"
        for e in edges
        if _layer(e.target) > _layer(e.source)
    ]
    assert not upward, "upward imports:\n" + "\n".join(upward)


def model_back_imports(edges: list[Import]) -> list[str]:
    return [
        f"{e.where}: {e.source} ({model_unit(e.source)}) imports {e.target} ({model_unit(e.target)}), "
        "which comes after it in MODEL_ORDER"
        for e in edges
        if top_name(e.source) == top_name(e.target) == "model" and model_rank(e.target) > model_rank(e.source)
    ]


def test_no_model_import_runs_back_up_model_order():
    edges, _ = all_imports()
    for module in our_modules():
        if top_name(module) == "model":
            model_rank(module)  # every module of model/ has its place
    back = model_back_imports(edges)
    assert not back, "imports inside model/ against its order:\n" + "\n".join(back)


def test_the_model_order_check_sees_a_back_import():
    def edge(a: str, b: str) -> Import:
        return Import(a, b, f"{a}.py:1", False)

    assert model_unit("ditfleet.model.qwen_image.transformer") == "<family>"
    assert model_unit("ditfleet.model.qwen_image.family") == "<family face>"
    assert (
        model_back_imports([edge("ditfleet.model.generation.pipeline", "ditfleet.model.memory.plan")]) == []
    )
    back = model_back_imports(
        [
            edge("ditfleet.model.loading.folder", "ditfleet.model.qwen_image.loader"),  # loading <-> networks
            edge("ditfleet.model.tiny.scenes", "ditfleet.model.family"),  # tiny -> family
            edge("ditfleet.model.settings", "ditfleet.model.generation.pipeline"),  # settings <-> generation
            edge("ditfleet.model.qwen_image.vae", "ditfleet.model.generation.scheduler"),
        ]
    )
    assert len(back) == 4 and "(loading) imports ditfleet.model.qwen_image.loader (<family face>)" in back[0]


@pytest.mark.slow
def test_model_imports_only_torch_safetensors_and_the_standard_library():
    _, every = all_imports()
    allowed = MODEL_MAY_IMPORT | set(sys.stdlib_module_names) | {"__future__"}
    outside = {(where, name) for where, name in every if where.startswith("model/") and name not in allowed}
    bad = sorted(
        f"{where}: imports {name}"
        for where, name in outside
        if (where.split(":")[0], name) not in MODEL_OPTIONAL_IMPORTS
    )
    assert not bad, "model/ imports outside torch, safetensors and the standard library:\n" + "\n".join(bad)
    stale = MODEL_OPTIONAL_IMPORTS - {(where.split(":")[0], name) for where, name in outside}
    assert not stale, f"MODEL_OPTIONAL_IMPORTS lists imports that are gone; delete them: {sorted(stale)}"


def _describe(components: list[list[str]], edges: list[Import]) -> str:
    where = {(e.source, e.target): e.where for e in edges}
    lines = []
    for component in components:
        inside = sorted(
            f"{where[(a, b)]}: {a} -> {b}" for a in component for b in component if (a, b) in where
        )
        lines.append(" <-> ".join(component) + "\n    " + "\n    ".join(inside))
    return "\n".join(lines)


@pytest.mark.slow
def test_no_import_cycle_between_our_modules():
    edges, _ = all_imports()
    at_load = [e for e in edges if e.at_load]
    found = cycles(at_load)
    assert not found, "import cycles (module level):\n" + _describe(found, at_load)


@pytest.mark.slow
def test_function_level_imports_close_only_the_listed_cycles():
    edges, _ = all_imports()
    found = cycles(edges)
    unlisted = [c for c in found if frozenset(c) not in DEFERRED_CYCLES]
    assert not unlisted, "cycles closed by function-level imports:\n" + _describe(unlisted, edges)
    stale = [sorted(c) for c in DEFERRED_CYCLES if sorted(c) not in found]
    assert not stale, f"DEFERRED_CYCLES lists cycles that are gone; delete them: {stale}"


def test_cycle_finder_finds_a_cycle_and_ignores_a_chain():
    def edge(a: str, b: str) -> Import:
        return Import(a, b, f"{a}.py:1", True)

    chain = [edge("a", "b"), edge("b", "c")]
    assert cycles(chain) == []
    assert cycles([*chain, edge("c", "a"), edge("c", "d")]) == [["a", "b", "c"]]


@pytest.mark.slow
def test_our_packages_are_imported_only_by_their_installed_names():
    """`import model` would find a user's own model/ first on a Ray worker's path (a job's
    working_dir); only `ditfleet.model` is ours for certain."""
    bare = []
    for folder in (*LAYERS, *REPO_FOLDERS):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for node, _ in _imports(ast.parse(path.read_text(), filename=rel)):
                names = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else ([node.module or ""] if not node.level else [])
                )
                bare += [f"{rel}:{node.lineno}: {n}" for n in names if n.split(".")[0] in LAYERS]
    assert not bare, "imports of our layers by their bare names (use ditfleet.<layer>):\n" + "\n".join(bare)


def _imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in one file, wherever it is written."""
    rel = path.relative_to(ROOT)
    source = ".".join(rel.with_suffix("").parts)
    found = []
    for node, _ in _imports(ast.parse(path.read_text(), filename=rel.as_posix())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        else:
            found.append((node.lineno, _absolute(node, source, path.name == "__init__.py")))
    return found


def _ours(module: str) -> bool:
    return module.split(".")[0] in (PACKAGE, *NOT_INSTALLED)


def _allowed(module: str, prefixes: set[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def test_recipes_bench_and_tests_import_only_what_their_rooms_allow():
    bad = []
    for folder, may in REPO_FOLDERS.items():
        paths = sorted((ROOT / folder).rglob("*.py"))
        assert paths, f"{folder}/ has no Python files: the check would prove nothing"
        for path in paths:
            rel = path.relative_to(ROOT).as_posix()
            bad += [
                f"{rel}:{line}: imports {module} ({folder}/ may import {', '.join(sorted(may))})"
                for line, module in _imported_modules(path)
                if _ours(module) and not _allowed(module, may)
            ]
    assert not bad, "imports across the repository's rooms:\n" + "\n".join(bad)


def test_installed_code_imports_nothing_that_is_not_installed():
    bad = []
    for folder in (*LAYERS, PACKAGE):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            bad += [
                f"{rel}:{line}: imports {module}"
                for line, module in _imported_modules(path)
                if module.split(".")[0] in NOT_INSTALLED
            ]
    assert not bad, f"installed code importing {', '.join(NOT_INSTALLED)} (not installed):\n" + "\n".join(bad)


@pytest.mark.slow
def test_the_layers_import_nothing_from_ditfleet_testing():
    """ditfleet.testing holds the builders tests/ and bench/ share: what a job or the node
    self-test runs never imports it (the published configs it reads are `model.qwen_image.published`)."""
    testing = f"{PACKAGE}.testing"
    bad = [
        f"{path.relative_to(ROOT).as_posix()}:{line}: imports {module}"
        for layer in LAYERS
        for path in sorted((ROOT / layer).rglob("*.py"))
        for line, module in _imported_modules(path)
        if _allowed(module, {testing})
    ]
    assert not bad, f"the layers import {testing}:\n" + "\n".join(bad)
