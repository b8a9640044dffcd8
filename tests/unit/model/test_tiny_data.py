"""The tiny model's data, text encoder and adherence check (no trained weights needed)."""

from __future__ import annotations

import pytest
import torch

from ditfleet.model.tiny.adherence import count_components, count_holes, ideal_iou, measure, score
from ditfleet.model.tiny.scenes import (
    HELD_OUT_COUNT,
    SIZE_FRACTION,
    TINY_BUCKETS,
    Scene,
    all_scenes,
    held_out_captions,
    parse_caption,
    render,
    sample_batch,
    split_scenes,
)
from ditfleet.model.tiny.text_encoder import TextEncoderConfig, TinyTextEncoder, WordTokenizer


def test_captions_round_trip_and_split_is_fixed_and_disjoint():
    scenes = all_scenes()
    assert len({s.caption for s in scenes}) == len(scenes) == 3 * 6 * 5 * 9 * 2
    for s in scenes:
        assert parse_caption(s.caption) == s
    assert parse_caption("A Large RED square in the center on a white background.") == Scene(
        "square", "red", "white", "centre", "large"
    )
    train, held = split_scenes()
    assert len(held) == HELD_OUT_COUNT
    assert not {s.caption for s in train} & {s.caption for s in held}
    assert len(train) + len(held) == len(scenes)
    # The rule depends only on the caption text: these are pinned so that a change is deliberate.
    assert held_out_captions()[:2] == [
        "a small red circle at the top right on a blue background",
        "a large blue circle on the left on a white background",
    ]


def test_bad_captions_and_scenes_say_what_is_wrong():
    with pytest.raises(ValueError, match="does not follow the template"):
        parse_caption("a photo of a cat")
    with pytest.raises(ValueError, match="unknown position phrase 'somewhere'"):
        parse_caption("a small red circle somewhere on a blue background")
    with pytest.raises(ValueError, match="both 'red'"):
        Scene("circle", "red", "red", "top", "small")


@pytest.mark.parametrize("width,height", TINY_BUCKETS)
def test_batches_are_deterministic_and_shapes_stay_inside_their_cell(width, height):
    train, _ = split_scenes()
    a, caps_a = sample_batch(train, 6, width, height, torch.Generator().manual_seed(3))
    b, caps_b = sample_batch(train, 6, width, height, torch.Generator().manual_seed(3))
    assert caps_a == caps_b and torch.equal(a, b)
    assert a.shape == (6, 3, height, width) and a.min() >= 0 and a.max() <= 1
    # Extreme jitter in a corner: the shape never touches the image border.
    corner = Scene("square", "white", "black", "bottom right", "large")
    image = render(corner, width, height, jitter=(1.0, 1.0))
    assert image[:, -2:, :].max() < 0.1 and image[:, :, -2:].max() < 0.1


@pytest.mark.slow
@pytest.mark.parametrize("width,height", TINY_BUCKETS)
def test_adherence_is_perfect_on_ground_truth(width, height):
    scenes = all_scenes()
    images, captions = sample_batch(scenes, 120, width, height, torch.Generator().manual_seed(0))
    result = score(images, captions)
    iou = result.pop("iou")
    assert result == {
        "shape_color": 1.0,
        "background": 1.0,
        "position": 1.0,
        "kind": 1.0,
        "size": 1.0,
        "one_blob": 1.0,
    }
    # Only the anti-aliased rim differs from the ideal shape.
    assert iou > 0.93, iou


@pytest.mark.slow
def test_adherence_is_near_chance_on_noise_and_catches_wrong_images():
    scenes = all_scenes()
    g = torch.Generator().manual_seed(1)
    _, captions = sample_batch(scenes, 300, 128, 128, g)
    noise = torch.rand(300, 3, 128, 128, generator=g)
    s = score(noise, captions)
    # Chance: 1/6 for colours, 1/9 for position, 1/3 for kind, 1/2 for size.
    assert s["shape_color"] < 0.3 and s["background"] < 0.3 and s["position"] < 0.2 and s["kind"] < 0.45, s
    assert s["size"] < 0.65 and s["one_blob"] < 0.05 and s["iou"] < 0.15, s
    # A correct image scored against a caption that differs in every attribute matches nothing.
    image = render(Scene("circle", "red", "blue", "top left", "large"), 128, 128)
    wrong = "a small green triangle at the bottom right on a white background"
    result = score(image[None], [wrong])
    assert result.pop("one_blob") == 1.0 and result.pop("iou") < 0.5, result
    assert result == {"shape_color": 0.0, "background": 0.0, "position": 0.0, "kind": 0.0, "size": 0.0}
    blank = torch.full((3, 128, 128), 0.5)
    assert measure(blank).color is None and measure(blank).position is None and measure(blank).blobs == 0


def test_size_blobs_and_iou_of_wrong_shapes():
    square = render(Scene("square", "white", "black", "centre", "large"), 128, 128)
    got = measure(square)
    assert (got.size, got.blobs, got.holes) == ("large", 1, 0)
    # The ideal of a different kind or size overlaps a large square only partly: a circle covers
    # pi/4 of it, a small square (small / large fraction)^2.
    mask = (square - square[:, :1, :1]).norm(dim=0) > 0.25
    assert ideal_iou(mask, got.centroid, "square", "large") > 0.95
    assert 0.7 < ideal_iou(mask, got.centroid, "circle", "large") < 0.85
    small_share = (SIZE_FRACTION["small"] / SIZE_FRACTION["large"]) ** 2
    assert ideal_iou(mask, got.centroid, "square", "small") < small_share + 0.05
    # Two shapes side by side are two blobs; a ring is one blob with a hole.
    two = torch.maximum(square, render(Scene("square", "white", "black", "left", "small"), 128, 128))
    assert measure(two).blobs == 2
    ring = square.clone()
    ring[:, 60:68, 60:68] = 0.06
    assert (measure(ring).blobs, measure(ring).holes) == (1, 1)


def test_component_and_hole_counting():
    m = torch.zeros(10, 12, dtype=torch.bool)
    m[1, 1] = m[2, 2] = True  # diagonal neighbours: one 8-connected component, two 4-connected ones
    m[5:7, 5:9] = True
    m[9, 0] = True
    assert count_components(m) == 3 and count_components(m, connectivity=4) == 4
    assert count_components(torch.zeros(4, 4, dtype=torch.bool)) == 0
    ring = torch.zeros(7, 7, dtype=torch.bool)
    ring[1:6, 1:6] = True
    ring[3, 3] = False
    assert count_holes(ring) == 1 and count_components(ring) == 1
    ring[3, 3] = True
    assert count_holes(ring) == 0
    with pytest.raises(ValueError, match="connectivity"):
        count_components(m, connectivity=6)


def _flood_fill_count(mask: torch.Tensor, connectivity: int) -> int:
    """The plain reference: visit each unvisited mask pixel's component breadth-first."""
    rows = mask.tolist()
    h, w = len(rows), len(rows[0])
    steps = [(0, 1), (1, 0), (0, -1), (-1, 0)]
    if connectivity == 8:
        steps += [(1, 1), (1, -1), (-1, 1), (-1, -1)]
    seen, count = set(), 0
    for y0 in range(h):
        for x0 in range(w):
            if rows[y0][x0] and (y0, x0) not in seen:
                count += 1
                seen.add((y0, x0))
                todo = [(y0, x0)]
                while todo:
                    y, x = todo.pop()
                    for dy, dx in steps:
                        n = (y + dy, x + dx)
                        if 0 <= n[0] < h and 0 <= n[1] < w and rows[n[0]][n[1]] and n not in seen:
                            seen.add(n)
                            todo.append(n)
    return count


def test_component_counts_equal_a_flood_fill_on_noise_blobs_and_snakes():
    g = torch.Generator().manual_seed(0)
    masks = [torch.rand(24, 31, generator=g) < p for p in (0.3, 0.45, 0.6, 0.8)]
    masks += [torch.nn.functional.avg_pool2d(torch.rand(1, 1, 40, 40, generator=g), 3, 1, 1)[0, 0] > 0.5]
    snake = torch.zeros(21, 21, dtype=torch.bool)  # one path winding through every other row
    for r in range(0, 21, 2):
        snake[r] = True
        if r + 1 < 21:
            snake[r + 1, 20 if r % 4 == 0 else 0] = True
    masks += [snake, snake.t(), ~snake]
    for mask in masks:
        for connectivity in (8, 4):
            assert count_components(mask, connectivity) == _flood_fill_count(mask, connectivity)
    assert count_components(snake) == 1 and count_holes(snake) == 0


def _encoder(tmp_path=None) -> TinyTextEncoder:
    words = sorted({w for s in all_scenes() for w in s.caption.split()})
    tok = WordTokenizer.from_words(words)
    torch.manual_seed(0)
    return TinyTextEncoder(TextEncoderConfig(vocab_size=len(tok)), tok).eval()


def test_text_encoder_contract_unknown_words_empty_prompt_and_save_load(tmp_path):
    enc = _encoder()
    prompts = ["a small red circle at the top left on a blue background", " ", "a purple elephant, dancing!"]
    with torch.no_grad():
        embeds, mask = enc.encode(prompts, max_length=512)
    assert embeds.shape == (3, 13, 64) and embeds.dtype == torch.float32
    assert mask.tolist()[1] == [1] + [0] * 12  # " " is <bos> alone
    ids, _ = enc.tokenize(prompts[2:], 512)
    assert ids.tolist() == [
        [2, enc.tokenizer.vocab["a"], 1, 1, 1]
    ]  # <bos>, "a", then <unk> for each unknown word
    assert torch.isfinite(embeds).all() and embeds[1, 1:].abs().max() == 0  # padding is zero
    with torch.no_grad():
        alone, alone_mask = enc.encode([" "])
    assert alone.shape == (1, 1, 64) and torch.allclose(
        alone[0], embeds[1, :1], atol=1e-5
    )  # padding does not leak
    truncated, _ = enc.encode(prompts[:1], max_length=4)
    assert truncated.shape[1] == 4
    enc.save(tmp_path)
    loaded = TinyTextEncoder.load(tmp_path)
    with torch.no_grad():
        again, again_mask = loaded.encode(prompts)
    assert torch.equal(again, embeds) and torch.equal(again_mask, mask)


def test_text_encoder_refuses_mismatched_files(tmp_path):
    from ditfleet.model.loading.weights import WeightsError

    enc = _encoder()
    enc.save(tmp_path)
    (tmp_path / "tokenizer" / "vocab.json").unlink()
    with pytest.raises(WeightsError, match="vocab.json: missing"):
        TinyTextEncoder.load(tmp_path)
    with pytest.raises(ValueError, match="'<bos>' must have id 2"):
        WordTokenizer({"<pad>": 0, "<unk>": 1, "a": 2})
