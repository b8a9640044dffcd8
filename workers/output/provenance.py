"""Provenance in an image file's own metadata: what made it, as other tools read it.

An image carries its row's prompt, negative prompt, seed, steps, CFG scale, size, the model's id,
revision and licence (where known: workers.weights.licence) and the job's name (`output.embed_metadata`, on by default):

- PNG: a `parameters` text chunk in the AUTOMATIC1111/Forge form that dataset tools parse,
  and a `ditfleet` chunk with the same facts as JSON; tEXt where the text is Latin-1, iTXt
  (UTF-8) where it is not.
- JPEG and WebP: EXIF (ImageDescription as UTF-8 bytes, as exiftool writes it; UserComment as
  "UNICODE\\0" + UTF-16 in the EXIF block's byte order, as the AUTOMATIC1111 web UI writes it)
  and an XMP packet (dc:description, and one ditfleet: element per fact).

An edit job's image says so and of what: `task` "edit" and its `sources` (URI and sha256 of each
source image, in the row's column order) among the facts, `Task: edit, Source 1: ..., Source 1
sha256: ...` in the infotext, an ordered rdf:Seq in XMP. A text job's image carries none of
these, so its bytes are what they were before edit jobs existed.

Everything here is a pure function of the row's settings and the job's model and name: no
time, host, worker or attempt, so every run of a shard, on any actor, makes the same bytes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from xml.sax.saxutils import escape

from PIL import Image
from PIL.PngImagePlugin import PngInfo

XMP_NAMESPACE = "urn:ditfleet:provenance:1/"
JSON_KEY = "ditfleet"  # the PNG text chunk that holds the facts as JSON
PARAMETERS_KEY = "parameters"  # the PNG text chunk AUTOMATIC1111, Forge and their readers use
NEGATIVE_PROMPT_LABEL = "Negative prompt:"  # the infotext line that starts the negative prompt

_EXIF_IFD = 0x8769
_IMAGE_DESCRIPTION = 0x010E
_USER_COMMENT = 0x9286
_UNICODE_PREFIX = b"UNICODE\x00"  # EXIF UserComment character code: UCS-2 in the block's byte order

# Characters XML 1.0 cannot hold (C0 controls but tab, newline, carriage return; U+FFFE, U+FFFF,
# lone surrogates): an XMP reader would reject the packet, so they become U+FFFD there.
_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


@dataclass(frozen=True)
class JobProvenance:
    """What every image of a job carries: the model it came from, its licence and the job's name."""

    model_id: str = ""
    model_revision: str = ""
    job_name: str | None = None
    model_license: str | None = None  # the licence id; None: not known, left out


@dataclass(frozen=True)
class Provenance:
    """What one stored image carries in its metadata. None: not known, left out."""

    prompt: str
    negative_prompt: str | None = None
    seed: int | None = None
    steps: int | None = None
    true_cfg_scale: float | None = None
    width: int | None = None
    height: int | None = None
    id: str | None = None
    k: int | None = None
    job: JobProvenance = field(default_factory=JobProvenance)
    # An edit's source images, (uri, sha256 hex) each, in the row's column order; None: a text job.
    sources: Sequence[tuple[str, str]] | None = None

    def __post_init__(self) -> None:
        if self.sources is None:
            return
        sources = tuple(tuple(pair) for pair in self.sources)
        bad = [p for p in sources if len(p) != 2 or not all(isinstance(v, str) for v in p)]
        if bad:
            raise ValueError(
                f"provenance of id={self.id!r}: a source is a (uri, sha256) pair of str, got {bad[0]!r}"
            )
        object.__setattr__(self, "sources", sources)  # hashable and fixed, as the record is

    def facts(self) -> dict[str, Any]:
        """The facts as JSON values, in a fixed order; what is not known is left out."""
        doc: dict[str, Any] = {
            "prompt": self.prompt,
            "negative_prompt": self.negative_prompt,
            "seed": self.seed,
            "steps": self.steps,
            "true_cfg_scale": None if self.true_cfg_scale is None else float(self.true_cfg_scale),
            "width": self.width,
            "height": self.height,
            "model_id": self.job.model_id or None,
            "model_revision": self.job.model_revision or None,
            "model_license": self.job.model_license,
            "job_name": self.job.job_name,
            "id": self.id,
            "k": self.k,
            "task": None if self.sources is None else "edit",
            "sources": None
            if self.sources is None
            else [{"uri": uri, "sha256": sha256} for uri, sha256 in self.sources],
        }
        return {key: value for key, value in doc.items() if value is not None}

    def to_json(self) -> str:
        """The facts as compact JSON (UTF-8 text, not escaped to ASCII)."""
        return json.dumps(self.facts(), ensure_ascii=False, separators=(",", ":"))

    def parameters(self) -> str:
        """The AUTOMATIC1111 "infotext": the prompt, a `Negative prompt:` line, then one line of
        `Key: value` pairs, values quoted as JSON where they hold a comma, colon, quote or newline.

            a red circle on a blue square
            Negative prompt: blurry
            Steps: 28, CFG scale: 4.0, Seed: 42, Size: 64x64, Model: tiny, Model hash: 3f0c..., License: apache-2.0, Job: demo

        An edit adds `Task: edit` and, per source i from 1, `Source i: "<uri>"` (quoted: a URI
        has a colon) and `Source i sha256: <hex>`.

        A prompt or negative prompt that the form cannot hold as it is (`_infotext_block`) is
        written as one JSON string instead, so a reader never takes part of a prompt for the
        negative prompt or the settings."""
        pairs: list[tuple[str, Any]] = [
            ("Steps", self.steps),
            ("CFG scale", None if self.true_cfg_scale is None else float(self.true_cfg_scale)),
            ("Seed", self.seed),
            ("Size", f"{self.width}x{self.height}" if self.width and self.height else None),
            ("Model", self.job.model_id or None),
            ("Model hash", self.job.model_revision or None),
            ("License", self.job.model_license),
            ("Job", self.job.job_name),
        ]
        if self.sources is not None:
            pairs.append(("Task", "edit"))
            for i, (uri, sha256) in enumerate(self.sources, 1):
                pairs += [(f"Source {i}", uri), (f"Source {i} sha256", sha256)]
        lines = [_infotext_block(self.prompt)]
        if self.negative_prompt and self.negative_prompt.strip():  # not the blank default " "
            lines.append(f"{NEGATIVE_PROMPT_LABEL} {_infotext_block(self.negative_prompt)}")
        lines.append(", ".join(f"{key}: {_quoted(value)}" for key, value in pairs if value is not None))
        return "\n".join(lines)

    # -- per format --------------------------------------------------------------------------

    def png_info(self) -> PngInfo:
        """PNG text chunks: `parameters`, then `ditfleet` (tEXt when Latin-1, else iTXt)."""
        info = PngInfo()
        for key, text in ((PARAMETERS_KEY, self.parameters()), (JSON_KEY, self.to_json())):
            if all(ord(c) < 0x100 for c in text):  # Latin-1
                info.add_text(key, text)
            else:  # UTF-8 with no language tag, uncompressed: what readers of `parameters` expect
                info.add_itxt(key, text, lang="", tkey="", zip=False)
        return info

    def exif(self, description: bool = True) -> bytes:
        """An EXIF block (starting "Exif\\0\\0") with the parameters text as UserComment and,
        with `description`, as ImageDescription."""
        text = self.parameters()
        exif = Image.Exif()
        exif.endian = ">"  # big-endian ("MM"), so UserComment's UCS-2 is UTF-16-BE
        if description:
            # EXIF says ASCII; UTF-8 bytes are what exiftool and most writers put there.
            exif[_IMAGE_DESCRIPTION] = text.encode("utf-8")
        exif.get_ifd(_EXIF_IFD)[_USER_COMMENT] = _UNICODE_PREFIX + text.encode("utf-16-be")
        return exif.tobytes()

    def xmp(self, description: bool = True) -> bytes:
        """An XMP packet (UTF-8): one ditfleet: element per fact and, with `description`, the
        parameters text as dc:description."""
        body = "".join(
            f"<ditfleet:{key}>{_xml_sources(value) if key == 'sources' else _xml_text(value)}</ditfleet:{key}>"
            for key, value in self.facts().items()
        )
        if description:
            body += (
                '<dc:description><rdf:Alt><rdf:li xml:lang="x-default">'
                f"{_xml_text(self.parameters())}</rdf:li></rdf:Alt></dc:description>"
            )
        packet = (
            '<?xpacket begin="\ufeff" id="W5M0MpCehiHzreSzNTczkc9d"?>'
            '<x:xmpmeta xmlns:x="adobe:ns:meta/">'
            '<rdf:RDF xmlns:rdf="http://www.w3.org/1999/02/22-rdf-syntax-ns#">'
            '<rdf:Description rdf:about="" xmlns:dc="http://purl.org/dc/elements/1.1/" '
            f'xmlns:ditfleet="{XMP_NAMESPACE}">{body}</rdf:Description>'
            "</rdf:RDF></x:xmpmeta>"
            '<?xpacket end="r"?>'
        )
        return packet.encode("utf-8")


def _infotext_block(text: str) -> str:
    """`text` as the infotext's prompt (or negative prompt) lines: as it is where AUTOMATIC1111's
    reader (`parse_generation_parameters`) gives it back unchanged, else as one JSON string.

    That reader strips the whole text and each line, splits lines at "\n" only, ends the prompt
    at a line starting "Negative prompt:" and drops that label from every negative line. So a
    text is held as it is when neither it nor any line has whitespace at either end (a "\r"
    included), no line starts with the label and it holds no NUL (PNG text cannot). A text that
    starts with a quote is escaped too, so that a block starting with a quote is always an
    escape: `json.loads` of it gives the exact text back (docs/quality.md)."""
    lines = text.split("\n")
    held = (
        "\x00" not in text
        and not text.startswith('"')
        and text == text.strip()
        and all(line == line.strip() and not line.startswith(NEGATIVE_PROMPT_LABEL) for line in lines)
    )
    return text if held else json.dumps(text, ensure_ascii=False)


def _quoted(value: Any) -> str:
    """A value of the infotext's last line as AUTOMATIC1111 writes it (its `quote`), and quoted
    too where its reader would change it unquoted: a quote (it unquotes a value that starts and
    ends with one), whitespace at either end (it strips), a carriage return."""
    if isinstance(value, float):
        return repr(value)
    text = str(value)
    if any(c in text for c in ',:\n\r"\x00') or text != text.strip():
        return json.dumps(text, ensure_ascii=False)
    return text


def _xml_sources(sources: list[dict[str, str]]) -> str:
    """The sources as an XMP ordered array of structures: rdf:Seq, one rdf:li per source in
    order, each with ditfleet:uri and ditfleet:sha256."""
    items = "".join(
        '<rdf:li rdf:parseType="Resource">'
        + "".join(f"<ditfleet:{key}>{_xml_text(value)}</ditfleet:{key}>" for key, value in source.items())
        + "</rdf:li>"
        for source in sources
    )
    return f"<rdf:Seq>{items}</rdf:Seq>"


def _xml_text(value: Any) -> str:
    """`value` as XML character data: escaped, carriage returns kept, unrepresentable characters
    replaced."""
    return escape(_NOT_XML.sub("\ufffd", str(value)), {"\r": "&#13;"})
