"""The model's licence travels with the images: read from the model card's front matter (hostile
and malformed cards give "not known", never a crash or code run), or given by the job; recorded
in _job.json's spec, the fingerprint (where the files embed it) and every image's metadata;
`model.require_commercial_licence: true` refused by validate, plan and run before any work."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from ditfleet.jobs.cli import main
from ditfleet.jobs.spec import SpecError, load_spec
from ditfleet.model.loading.folder import TINY_MODEL_DIR
from ditfleet.workers.output.manifest import MANIFEST_SCHEMA
from ditfleet.workers.output.provenance import JobProvenance, Provenance
from ditfleet.workers.weights.licence import (
    CARD_MAX_BYTES,
    KNOWN_LICENCES,
    LicenceRefused,
    ModelLicence,
    card_licence,
    read_model_licence,
)
from tests.support.model_fixtures import job_with_model as job
from tests.support.model_fixtures import tiny_model_copy

FLUX_DEV_CARD = """---
language:
- en
license: other
license_name: flux-1-dev-non-commercial-license
license_link: LICENSE.md
tags:
- text-to-image
---

# FLUX.1 [dev]
"""


def lic(card: str | bytes) -> ModelLicence:
    return card_licence(card.encode() if isinstance(card, str) else card, "m/README.md")


# -- the model card's front matter ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("card", "expected"),
    [
        ("---\nlicense: apache-2.0\n---\n# Qwen-Image\n", "apache-2.0"),
        (FLUX_DEV_CARD, "flux-1-dev-non-commercial-license"),
        ("\ufeff---\r\nlicense: MIT\r\npipeline_tag: text-to-image\r\n---\r\n", "mit"),  # BOM, CRLF, case
        ("---\nlicense: 'apache-2.0'  # quoted, with a comment\n...\n", "apache-2.0"),
        ("---\nlicense: other\n---\n", "other"),  # no license_name: "other" as given (not known)
    ],
)
def test_front_matter_names_the_licence(card, expected):
    got = lic(card)
    assert got.id == expected and got.source == "m/README.md front matter"


@pytest.mark.parametrize(
    ("card", "why"),
    [
        ("", "no front matter"),
        ("# A model\nlicense: apache-2.0\n", "no front matter"),  # the body is not the front matter
        ("---\nlicense: apache-2.0\n", "no closing '---'"),
        ("---\nlicense: [apache-2.0, mit]\n---\n", "license in its front matter is not one licence id"),
        ("---\nlicense: {name: x}\n---\n", "not one licence id"),
        ("---\nlicense: 2\n---\n", "not one licence id (got 2)"),
        ("---\nlicense: other\nlicense_name: [a]\n---\n", "license_name in its front matter is not one"),
        ("---\nlicense: 'apache-2.0\\nSteps: 1'\n---\n", "is not a licence id"),  # a newline smuggled in
        ('---\nlicense: "apache 2.0, or so"\n---\n', "is not a licence id"),
        ("---\nlicense: " + "a" * 101 + "\n---\n", "is not a licence id"),
        ("---\ntags: [a\n---\n", "not valid YAML"),
        ("---\n\tlicense: mit\n---\n", "not valid YAML"),
        ("---\n- license: mit\n---\n", "not a mapping"),
        ("---\npipeline_tag: text-to-image\n---\n", "no license key"),
        ("---\n" + "x: " + "y" * 70_000 + "\n---\n", "over 65536 bytes"),
    ],
)
def test_malformed_front_matter_gives_not_known_with_the_reason(card, why):
    got = lic(card)
    assert got.id is None and why in got.source and got.source.startswith("m/README.md"), got.source
    assert got.commercial_use is None


def test_hostile_front_matter_runs_nothing_and_stays_small(tmp_path):
    marker = tmp_path / "ran"
    # A tag that a full loader would call: safe_load refuses it, nothing runs.
    code = f"---\nlicense: !!python/object/apply:os.system ['touch {marker}']\n---\n"
    assert lic(code).id is None and "not valid YAML" in lic(code).source
    assert not marker.exists()
    # An alias bomb: aliases are shared references, so this loads in microseconds and small.
    bomb = "---\na: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n"
        for p, c in zip("abcdefgh", "bcdefghi")
    )
    assert lic(bomb + "license: apache-2.0\n---\n").id == "apache-2.0"
    # Bytes that are not UTF-8, and a card far longer than what is read.
    assert lic(b"---\nlicense: mit\n---\n\xff\xfe\x00garbage").id == "mit"
    assert lic(b"---\nlicense: mit\n" + b"#" * (2 * CARD_MAX_BYTES) + b"\n---\n").id is None


def test_read_from_a_local_folder_and_the_bundled_model(tmp_path):
    assert read_model_licence("m", tmp_path).id is None
    assert "README.md not found" in read_model_licence("m", tmp_path).source
    (tmp_path / "README.md").write_text(FLUX_DEV_CARD)
    got = read_model_licence(str(tmp_path), tmp_path)
    assert got.id == "flux-1-dev-non-commercial-license" and got.commercial_use is False
    assert read_model_licence("tiny", TINY_MODEL_DIR).id is None  # the bundled model has no card
    hub = read_model_licence("hf://org/name@main", None)
    assert hub.id is None and "give model.license" in hub.source


# -- the table and the refusal -------------------------------------------------------------------


def test_the_table_decides_commercial_use():
    assert ModelLicence("apache-2.0", "x").commercial_use is True
    for non_commercial in (
        "flux-1-dev-non-commercial-license",
        "flux-dev-non-commercial-license",
        "qwen-research",
    ):
        assert KNOWN_LICENCES[non_commercial].commercial_use is False
    ModelLicence("apache-2.0", "x").check_commercial()  # passes
    with pytest.raises(
        LicenceRefused, match=r"'flux-1-dev-non-commercial-license' \(from x\) does not permit"
    ):
        ModelLicence("flux-1-dev-non-commercial-license", "x").check_commercial()
    with pytest.raises(LicenceRefused, match="is not known .*give its id as model.license"):
        ModelLicence(None, "m/README.md not found").check_commercial()
    with pytest.raises(LicenceRefused, match="'my-licence' .* is not one ditfleet knows.*KNOWN_LICENCES"):
        ModelLicence("my-licence", "x").check_commercial()


# -- the job -------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["validate", "plan", "run"])
def test_a_non_commercial_licence_is_refused_before_any_work(tmp_path, capsys, command):
    path = job(tmp_path, tiny_model_copy(tmp_path, FLUX_DEV_CARD), "  require_commercial_licence: true\n")
    assert main([command, str(path)]) == 2
    err = capsys.readouterr().err
    assert (
        "require_commercial_licence: true, but the model's licence 'flux-1-dev-non-commercial-license'" in err
    )
    assert "FLUX.1 [dev] Non-Commercial License" in err and str(tmp_path / "model" / "README.md") in err
    assert not (tmp_path / "out").exists()


def test_an_unknown_licence_is_refused_with_what_to_do_and_the_job_may_name_it(tmp_path, capsys):
    path = job(tmp_path, tiny_model_copy(tmp_path), "  require_commercial_licence: true\n")
    assert main(["plan", str(path)]) == 2
    assert "give its id as model.license (e.g. model.license: apache-2.0)" in capsys.readouterr().err
    named = job(tmp_path, tmp_path / "model", "  require_commercial_licence: true\n  license: Apache-2.0\n")
    assert main(["plan", str(named)]) == 0
    assert (
        "licence: apache-2.0 (from model.license in the job; commercial use: yes)" in capsys.readouterr().out
    )


def test_without_require_a_non_commercial_licence_is_recorded_not_refused(tmp_path, capsys):
    path = job(tmp_path, tiny_model_copy(tmp_path, FLUX_DEV_CARD))
    assert main(["plan", str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["licence"]["id"] == "flux-1-dev-non-commercial-license"
    assert info["licence"]["commercial_use"] is False
    spec = load_spec(path)
    model = spec.resolved()["model"]  # what _job.json stores
    assert (
        model["license"] == "flux-1-dev-non-commercial-license" and model["license_commercial_use"] is False
    )
    assert model["license_source"] == f"{tmp_path / 'model' / 'README.md'} front matter"
    assert spec.to_worker_config().model_license == "flux-1-dev-non-commercial-license"


def test_the_licence_enters_the_fingerprint_only_where_the_files_carry_it(tmp_path):
    card = tiny_model_copy(tmp_path, "---\nlicense: apache-2.0\n---\n")
    spec = load_spec(job(tmp_path, card))
    assert spec.image_settings()["model_license"] == "apache-2.0"
    off = spec.with_changes(output={"embed_metadata": False})
    assert "model_license" not in off.image_settings()
    assert off.to_worker_config().model_license == "apache-2.0"  # the manifests still name it
    unknown = load_spec(job(tmp_path, "tiny"))
    assert "model_license" not in unknown.image_settings()  # outputs planned before keep their fingerprint


def test_a_licence_that_is_not_an_id_is_a_spec_error(tmp_path):
    with pytest.raises(SpecError, match=r"job.yaml:6: model.license: 'apache 2' is not a licence id"):
        load_spec(job(tmp_path, "tiny", "  license: apache 2\n"))


# -- where it is recorded: metadata and manifest -------------------------------------------------


def test_provenance_names_the_licence_and_leaves_it_out_when_not_known():
    with_licence = Provenance("p", seed=1, job=JobProvenance("m", "rev", "j", "apache-2.0"))
    assert with_licence.facts()["model_license"] == "apache-2.0"
    assert "License: apache-2.0" in with_licence.parameters()
    assert "<ditfleet:model_license>apache-2.0</ditfleet:model_license>" in with_licence.xmp().decode()
    without = Provenance("p", seed=1, job=JobProvenance("m", "rev", "j"))
    assert "model_license" not in without.facts() and "License" not in without.parameters()


def test_the_manifest_has_a_nullable_model_license_column_after_the_older_ones():
    field = MANIFEST_SCHEMA.field("model_license")
    assert field.type == pa.string() and field.nullable
    # after every column older than it, before the edit jobs' later ones: older manifests read with it null
    assert MANIFEST_SCHEMA.names[-3:] == ["model_license", "source_uris", "source_sha256"]
