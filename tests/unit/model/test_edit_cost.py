"""What an edit costs against the text job at the same size, as the family counts it: each source
adds its latent tokens (at the VAE's source size, model.qwen_image.edit.source_tokens) to every
DiT forward, and Qwen2.5-VL's vision tokens to the prompt the DiT sees (EditStyle.prompt_tokens).
No timing: the arithmetic, and the formula against torch's own FLOP count of the DiT's forward."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from ditfleet.model.qwen_image.edit import EDIT_STYLES, source_tokens
from ditfleet.model.qwen_image.family import QWEN_IMAGE

PUBLISHED = QWEN_IMAGE.published_config("transformer/config.json")
D, LAYERS, TEXT = 3072, 60, 64


def _by_hand(image_tokens: int, text_tokens: int = TEXT) -> int:
    """test_family_table's formula: linears, attention over all tokens, modulation, embeddings."""
    T = image_tokens + text_tokens
    blocks = LAYERS * (2 * T * 12 * D * D + 4 * T * T * D + 24 * D * D)
    return blocks + 2 * (image_tokens * 64 * D + text_tokens * 3584 * D)


def test_one_source_at_the_targets_size_doubles_the_image_tokens():
    text = QWEN_IMAGE.forward_flops(PUBLISHED, 1024, 1024, TEXT)
    edit = QWEN_IMAGE.forward_flops(PUBLISHED, 1024, 1024, TEXT, sources=[(1024, 1024)])
    assert source_tokens([(1024, 1024)]) == 64 * 64  # the target's own 4,096
    assert text == _by_hand(4096) and edit == _by_hand(2 * 4096)
    # linears double, attention (quadratic in the tokens) quadruples: a little over twice the text job
    assert 2.0 < edit / text < 2.5
    two = QWEN_IMAGE.forward_flops(PUBLISHED, 1024, 1024, TEXT, sources=[(1024, 1024)] * 2)
    assert two == _by_hand(3 * 4096) and 3.5 < two / text < 4.5


def test_a_source_is_encoded_at_the_vae_area_whatever_the_targets_size():
    # 1328x1328 target (6,889 tokens): a source of the same size is encoded at 1024x1024 (4,096)
    assert source_tokens([(1328, 1328)]) == 4096
    edit = QWEN_IMAGE.forward_flops(PUBLISHED, 1328, 1328, TEXT, sources=[(1328, 1328)])
    assert edit == _by_hand(83 * 83 + 4096)
    assert 1.5 < edit / QWEN_IMAGE.forward_flops(PUBLISHED, 1328, 1328, TEXT) < 2.0
    # a small source is scaled up to the area, an elongated one keeps its aspect (multiples of 32)
    assert source_tokens([(512, 512)]) == 4096
    assert source_tokens([(2048, 1024)]) == (1440 // 16) * (736 // 16)
    assert source_tokens([(2048, 1024), (512, 512)]) == 90 * 46 + 4096
    assert source_tokens([]) == 0


def test_qwen_vl_sees_each_source_as_prompt_tokens():
    plus, first = EDIT_STYLES["QwenImageEditPlusPipeline"], EDIT_STYLES["QwenImageEditPipeline"]
    # Plus: 384x384 -> 392x392 by Qwen2.5-VL's resize, 14x14 merged tokens of 28 px, "Picture 1: " and markers
    assert plus.prompt_tokens(1024, 1024) == 14 * 14 + 5 + 2
    # the first edit model shows Qwen2.5-VL the VAE's size: 1024 -> 1036 = 37 x 28
    assert first.prompt_tokens(1024, 1024) == 37 * 37 + 2


def _counted(config: dict, grids: list[tuple[int, int]], text_tokens: int) -> int:
    """torch's FLOP count of one forward of the DiT of `config` on the meta device (no weights, no
    arithmetic): the target's grid first, then each source's."""
    dit = QWEN_IMAGE.empty_transformer(config)
    tokens = sum(h * w for h, w in grids)
    x = torch.empty(1, tokens, dit.img_in.in_features, device="meta")
    txt = torch.empty(1, text_tokens, config["joint_attention_dim"], device="meta")
    t = torch.full((1,), 0.5, device="meta")
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        dit(x, txt, None, t, [[(1, h, w) for h, w in grids]])
    return counter.get_total_flops()


@pytest.mark.parametrize("sources", [0, 1, 2], ids=["text", "one source", "two sources"])
def test_the_formula_is_what_the_dits_forward_computes(sources):
    """Published widths, two blocks, 1024x1024 target and sources of its size: the family's count
    within 0.5% of torch's (the formula leaves out the timestep embedding and the output layer)."""
    config = QWEN_IMAGE.published_config("transformer/config.json", num_layers=2)
    counted = _counted(config, [(64, 64)] * (1 + sources), TEXT)
    formula = QWEN_IMAGE.forward_flops(config, 1024, 1024, TEXT, sources=[(1024, 1024)] * sources)
    assert formula == pytest.approx(counted, rel=5e-3)
