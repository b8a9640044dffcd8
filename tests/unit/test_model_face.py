"""The model's face (model/family.py): no module above model/ names what is Qwen-Image's own.

compile/, workers/, driver/, jobs/ and ditfleet/ are parsed with `ast` (nothing is imported) and
a test fails, naming the file and line, on any identifier, attribute, keyword, imported name or
string constant (docstrings aside: prose may describe the model) that is Qwen-Image-specific:

- a submodule, parameter, attribute or method of the DiT, read off the model itself: the module
  tree of a `QwenImageTransformer` built on the meta device (`transformer_blocks`, `img_mod`,
  `attn.to_q`, ...), the attributes its transformer, blocks and attention set, the methods those
  classes define (`attention_inputs`, ...) and the transformer config's keys;
- the classes model/qwen_image/transformer.py defines;
- the constants of every family module, model/<family>/family.py (`QWEN_IMAGE_BUCKETS`,
  `TINY_BUCKETS`, `QWEN_IMAGE`, `QwenImageFamily`, ...), which only model/ names; above it a family
  is reached through `model_family(...)`.

A string constant counts when it holds such a name as a word ("transformer_blocks.{index}" or a
getattr name), so a name cannot come back disguised as text.

Nor does any module above model/ import a family's folder (`ditfleet.model.qwen_image...`, module-level,
in a function or under TYPE_CHECKING): what it needs of a family comes through model/family.py.
No module is exempt from that (the test scaffolding of EXEMPT aside, which builds Qwen-Image models).
"""

from __future__ import annotations

import ast
import re
from dataclasses import fields
from pathlib import Path

import pytest
import torch

import ditfleet.model.qwen_image.transformer as transformer_module
from ditfleet.model.qwen_image.transformer import QwenImageTransformer, TransformerConfig
from tests.support.paths import REPO

ABOVE_MODEL = ("compile", "workers", "driver", "jobs", "ditfleet")
# Paths allowed to name the DiT's internals, each with why. Each is a debt to move behind the
# face, except test scaffolding; a listed path that no longer names any fails the test (then
# delete its line), so the list only shrinks.
EXEMPT = {
    "ditfleet/testing/": "test scaffolding that writes published-width Qwen-Image checkpoints on purpose",
}

# Names the DiT uses that are ordinary words or settings elsewhere too; each is allowed above
# model/ because it means something there that is not the DiT's own.
GENERIC = {
    "act": "an activation, anywhere",
    "body": "an HTTP body, a report's body",
    "config": "every layer's config object",
    "device": "a tensor's, a module's, a pipeline's or a job's device",
    "dtype": "a tensor's or a setting's dtype",
    "eps": "an epsilon",
    "forward": "nn.Module's own method",
    "head_dim": "an attention head size, any model",
    "heads": "attention heads, any model",
    "in_channels": "a conv/linear's input channels",
    "index": "a shard's, a bucket's, a list's index",
    "linear": "nn.Linear, walked generically by compile.cpu_linear",
    "modulation": "the project's modulation cache, by name",
    "modulation_cache": "the job setting model.modulation_cache",
    "net": "a network",
    "num_layers": "a layer count, any model",
    "out_channels": "a conv/linear's output channels",
    "patch_size": "a patch size, any model",
    "proj": "a projection",
    "rope": "rotary embeddings, any model",
}


def _dit_names() -> set[str]:
    config = TransformerConfig(
        num_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        axes_dims_rope=(4, 6, 6),
    )
    with torch.device("meta"):
        transformer = QwenImageTransformer(config)
    block = transformer.transformer_blocks[0]
    names: set[str] = set()
    for path, _ in [*transformer.named_modules(), *transformer.named_parameters()]:
        names |= {p for p in path.split(".") if p and not p.isdigit()}
    for obj in (transformer, block, block.attn):
        names |= {k for k in vars(obj) if not k.startswith("_")}
        names |= {k for k in vars(type(obj)) if not k.startswith("_")}
    names |= {f.name for f in fields(TransformerConfig)}
    # What torch itself defines on every module is no knowledge of this model.
    names -= set(dir(torch.nn.Linear(1, 1)))
    return names - set(GENERIC)


def _defined_classes(module) -> set[str]:
    tree = ast.parse(Path(module.__file__).read_text())
    return {n.name for n in tree.body if isinstance(n, ast.ClassDef)}


def family_modules() -> list[Path]:
    """Every family's module: model/<family>/family.py (one folder per family)."""
    return sorted((REPO / "model").glob("*/family.py"))


def _family_constants() -> set[str]:
    """Module-level constants of each family module (model/<family>/family.py, the names it defines
    or imports) that are one family's, not the face's types; and its family classes."""
    names = set()
    for path in family_modules():
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.Assign):
                names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
            elif isinstance(node, ast.ImportFrom):
                names |= {a.asname or a.name for a in node.names}
            elif isinstance(node, ast.ClassDef) and node.name.endswith("Family"):
                names.add(node.name)
    # A bare TINY is left out: "tiny" is a model path the spec names (and a common local name).
    return {n for n in names if n.startswith(("QWEN_", "_")) or n.endswith(("_BUCKETS", "Family"))}


FORBIDDEN = frozenset(_dit_names() | _defined_classes(transformer_module) | _family_constants())
WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _docstrings(tree: ast.Module) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids


def named(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, name) of every Qwen-specific name the module writes."""
    skip = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        words: list[str] = []
        if isinstance(node, ast.Name):
            words = [node.id]
        elif isinstance(node, ast.Attribute):
            words = [node.attr]
        elif isinstance(node, ast.alias):
            words = [*node.name.split("."), *([node.asname] if node.asname else [])]
        elif isinstance(node, (ast.keyword, ast.arg)) and node.arg:
            words = [node.arg]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            words = [node.name]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            words = WORD.findall(node.value)
        found += [(getattr(node, "lineno", 0), w) for w in words if w in FORBIDDEN]
    return found


def modules_above_model() -> list[Path]:
    return [
        p
        for layer in ABOVE_MODEL
        for p in sorted((REPO / layer).rglob("*.py"))
        if not p.relative_to(REPO).as_posix().startswith(tuple(EXEMPT))
    ]


@pytest.mark.parametrize("prefix", sorted(EXEMPT))
def test_every_exemption_is_still_needed(prefix):
    paths = sorted((REPO / prefix).rglob("*.py"))
    if not paths:
        pytest.skip(f"{prefix} is not here")
    assert any(named(ast.parse(p.read_text())) for p in paths), (
        f"{prefix} names nothing Qwen-specific: drop it from EXEMPT"
    )


def test_the_forbidden_list_is_read_off_the_model():
    # A sample of what the list must hold, so that a change in how it is derived cannot empty it.
    assert {"transformer_blocks", "img_mod", "txt_mod", "img_mlp", "to_q", "attention_inputs"} <= FORBIDDEN
    assert {"attention_outputs", "attention_stats", "joint_attention_dim"} <= FORBIDDEN
    assert {"QWEN_IMAGE_BUCKETS", "TINY_BUCKETS", "QwenImageTransformer"} <= FORBIDDEN
    assert not FORBIDDEN & set(GENERIC)


def test_every_family_folder_has_a_family_module_read_here():
    """A family is a folder of model/ with its family.py; each one's constants are forbidden above."""
    assert "qwen_image" in [p.parent.name for p in family_modules()]
    assert {"QWEN_IMAGE", "QWEN_IMAGE_COMPILE_REGIONS", "QwenImageFamily", "TINY_BUCKETS"} <= FORBIDDEN


def test_the_check_catches_each_way_of_naming():
    source = (
        "from ditfleet.model.family import QWEN_IMAGE_BUCKETS\n"
        "x = pipe.transformer.transformer_blocks\n"
        "getattr(block, 'attention_inputs')\n"
        "LABEL = 'transformer_blocks.{index}'\n"
        "def f(img_mod): ...\n"
    )
    assert sorted(named(ast.parse(source))) == [
        (1, "QWEN_IMAGE_BUCKETS"),
        (2, "transformer_blocks"),
        (3, "attention_inputs"),
        (4, "transformer_blocks"),
        (5, "img_mod"),
    ]
    assert named(ast.parse('"""The attn.to_q of every transformer_blocks entry."""\n')) == []


@pytest.mark.parametrize("layer", ABOVE_MODEL)
def test_no_module_above_model_names_qwen_image_specifics(layer):
    problems = []
    for path in modules_above_model():
        rel = path.relative_to(REPO).as_posix()
        if not rel.startswith(f"{layer}/"):
            continue
        for line, name in named(ast.parse(path.read_text(), filename=rel)):
            problems.append(f"{rel}:{line}: {name}")
    assert not problems, (
        "Qwen-Image specifics above model/; ask the model's face (model/family.py: "
        "model_family(...).compile_regions, .default_buckets, .memory, .attention_counters, ...) instead:\n"
        + "\n".join(problems)
    )


def family_folders() -> set[str]:
    return {p.parent.name for p in family_modules()}


def family_imports(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, module) of every import of a family's folder, `ditfleet.model.<family>...`."""
    folders = family_folders()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules = [node.module]
        elif isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        else:
            continue
        for module in modules:
            parts = module.split(".")
            if parts[:2] == ["ditfleet", "model"] and len(parts) > 2 and parts[2] in folders:
                found.append((node.lineno, module))
    return found


def test_the_import_check_catches_each_way_of_importing():
    source = (
        "from ditfleet.model.qwen_image.published.schedules import by_lora\n"
        "import ditfleet.model.qwen_image.fp8\n"
        "def f():\n"
        "    from ditfleet.model.qwen_image import loader\n"
        "from ditfleet.model.family import model_family\n"
        "from ditfleet.model.generation.pipeline import TextToImagePipeline\n"
    )
    assert family_imports(ast.parse(source)) == [
        (1, "ditfleet.model.qwen_image.published.schedules"),
        (2, "ditfleet.model.qwen_image.fp8"),
        (4, "ditfleet.model.qwen_image"),
    ]


# model/'s shared machinery, which every family runs through: it asks the family (a Protocol it
# defines, or what the family hands it) and imports no family's folder.
FAMILY_FREE = {
    "model/memory/plan.py": "the shapes come from the family's ModelMemory (parameters, activation peaks, "
    "the FP8 GEMMs' transients, the modulation table)",
    "model/generation/sampling.py": "the loop calls the family's denoiser with what its prepare_inputs made",
    "model/generation/components.py": "the Protocols a family's modules meet",
    "model/generation/pipeline.py": "its modules are Protocols, its prepare_inputs and an edit model's "
    "EditConditioning (sources checked, encoded, bound to the DiT's inputs) the family's",
}


def test_the_pipeline_is_typed_with_protocols_and_run_on_the_familys_prepare_inputs():
    """TextToImagePipeline's modules are typed with model.generation.components' Protocols, not a
    family's classes, and the loop calls the DiT with what the family's prepare_inputs makes."""
    import inspect

    from ditfleet.model import load_pipeline
    from ditfleet.model.family import model_family
    from ditfleet.model.generation.pipeline import TextToImagePipeline

    params = inspect.signature(TextToImagePipeline.__init__).parameters
    assert {k: params[k].annotation for k in ("transformer", "vae", "text_encoder", "edit")} == {
        "transformer": "Denoiser",
        "vae": "Vae",
        "text_encoder": "TextEncoder | None",
        "edit": "EditConditioning | None",
    }
    assert params["prepare_inputs"].kind is inspect.Parameter.KEYWORD_ONLY
    pipe = load_pipeline("tiny")
    assert pipe.prepare_inputs is model_family(pipe).prepare_inputs
    assert (pipe.device, pipe.dtype) == (pipe.transformer.device, pipe.transformer.dtype)


def test_an_edit_model_is_handed_its_familys_conditioning_and_needs_a_vae_that_encodes(tmp_path):
    """An edit checkpoint's pipeline holds its family's EditConditioning (components), and encodes
    sources only on a VAE that encodes (components.SourceVae): one that only decodes is refused by
    name, where the pipeline once cast any VAE to the family's class."""
    pytest.importorskip("diffusers")
    from PIL import Image

    from ditfleet.model import load_pipeline
    from ditfleet.model.generation.components import SourceVae
    from ditfleet.testing.models import write_toy_edit_checkpoint

    pipe = load_pipeline(write_toy_edit_checkpoint(tmp_path / "edit"))
    assert pipe.task == "edit" and pipe.edit is not None and isinstance(pipe.vae, SourceVae)
    vae = pipe.vae

    class DecodeOnly:
        def decode(self, z: torch.Tensor) -> torch.Tensor:
            return vae.decode(z)

        def denormalize(self, z: torch.Tensor) -> torch.Tensor:
            return vae.denormalize(z)

        def parameters(self):
            return vae.parameters()

    pipe.vae = DecodeOnly()
    with pytest.raises(TypeError, match="VAE must encode its sources .* DecodeOnly does not"):
        pipe.encode_guidance(["a red cube"], sources=[[Image.new("RGB", (64, 64))]])


@pytest.mark.parametrize("rel", sorted(FAMILY_FREE))
def test_the_shared_machinery_imports_no_family(rel):
    problems = [
        f"{rel}:{line}: imports {module}"
        for line, module in family_imports(ast.parse((REPO / rel).read_text()))
    ]
    assert not problems, f"{FAMILY_FREE[rel]}:\n" + "\n".join(problems)


@pytest.mark.parametrize("layer", ABOVE_MODEL)
def test_no_module_above_model_imports_a_family_folder(layer):
    problems = [
        f"{path.relative_to(REPO).as_posix()}:{line}: imports {module}"
        for path in modules_above_model()
        if path.relative_to(REPO).as_posix().startswith(f"{layer}/")
        for line, module in family_imports(ast.parse(path.read_text()))
    ]
    assert not problems, (
        "a family's folder imported above model/; expose what is needed through model/family.py "
        "(as PUBLISHED_SCHEME, published_file, schedule_by_lora, ...) and import it from there:\n"
        + "\n".join(problems)
    )
