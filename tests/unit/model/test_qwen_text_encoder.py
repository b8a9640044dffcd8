"""QwenVLTextEncoder against diffusers' QwenImagePipeline.encode_prompt.

Both run on the same tiny random Qwen2.5-VL and a byte-level BPE tokenizer built here, so no
weights or tokenizer files are fetched.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("diffusers")

from ditfleet.model.qwen_image.text_encoder import (  # noqa: E402
    QWEN_IMAGE_DROP_TOKENS,
    QWEN_IMAGE_TEMPLATE,
    QwenVLTextEncoder,
)
from tests.support.qwen_text_encoder import PROMPTS, make_text_encoder, make_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def qwen_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen")
    tok = make_tokenizer(root / "tokenizer")
    model = make_text_encoder(root / "text_encoder")
    return root, model, tok


def test_template_is_longer_than_dropped_head(qwen_dirs):
    _, _, tok = qwen_dirs
    empty = tok(QWEN_IMAGE_TEMPLATE.format("")).input_ids
    assert len(empty) > QWEN_IMAGE_DROP_TOKENS
    assert empty[0] == tok.convert_tokens_to_ids("<|im_start|>")
    # The dropped head lies inside the system prompt, before the user's text starts.
    head = tok.decode(empty[:QWEN_IMAGE_DROP_TOKENS])
    assert QWEN_IMAGE_TEMPLATE.startswith(head)
    assert "user" not in head


def test_matches_diffusers_encode_prompt(qwen_dirs):
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline

    root, _, _ = qwen_dirs
    ours = QwenVLTextEncoder.from_dirs(root / "text_encoder", root / "tokenizer", "cpu", torch.float32)
    assert ours.hidden_size == 32
    embeds, mask = ours.encode(PROMPTS, max_length=512)

    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    ref_model = Qwen2_5_VLForConditionalGeneration.from_pretrained(
        str(root / "text_encoder"), torch_dtype=torch.float32
    ).eval()
    ref_tok = AutoTokenizer.from_pretrained(str(root / "tokenizer"))
    pipe = QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=None,
        text_encoder=ref_model,
        tokenizer=ref_tok,
        transformer=None,
    )
    with torch.no_grad():
        ref_embeds, ref_mask = pipe.encode_prompt(PROMPTS, device="cpu", max_sequence_length=512)
    if ref_mask is None:  # diffusers drops an all-ones mask
        ref_mask = torch.ones(ref_embeds.shape[:2], dtype=torch.long)

    lengths = mask.sum(1).tolist()
    assert len(set(lengths)) == 3 and min(lengths) > 0  # three different lengths, none empty
    # The tokenizer alone predicts every embedding length (the worker batches by it).
    assert ours.count_tokens(PROMPTS, 512) == lengths
    assert ours.count_tokens(PROMPTS, 8) == [min(n, 8) for n in lengths]
    assert embeds.shape == ref_embeds.shape == (3, max(lengths), 32)
    assert embeds.dtype == torch.float32
    assert torch.equal(mask.long(), ref_mask.long())
    assert (embeds[mask == 0] == 0).all()
    assert (embeds - ref_embeds).abs().max().item() <= 1e-5

    # Truncation to max_length matches diffusers' max_sequence_length slicing.
    short, short_mask = ours.encode(PROMPTS, max_length=8)
    with torch.no_grad():
        ref_short, ref_short_mask = pipe.encode_prompt(PROMPTS, device="cpu", max_sequence_length=8)
    assert short.shape == ref_short.shape
    assert (short - ref_short).abs().max().item() <= 1e-5
    if ref_short_mask is None:
        ref_short_mask = torch.ones(ref_short.shape[:2], dtype=torch.long)
    assert torch.equal(short_mask.long(), ref_short_mask.long())


def test_load_pipeline_picks_qwen_text_encoder(qwen_dirs, tmp_path):
    import shutil

    from ditfleet.model.qwen_image.loader import load_pipeline
    from ditfleet.testing.models import make_diffusers_model_dir

    src, _, _ = qwen_dirs
    root = make_diffusers_model_dir(tmp_path / "model", transformer_overrides={"joint_attention_dim": 32})
    shutil.copytree(src / "text_encoder", root / "text_encoder")
    shutil.copytree(src / "tokenizer", root / "tokenizer")
    config = json.loads((root / "text_encoder" / "config.json").read_text())
    assert config["architectures"] == ["Qwen2_5_VLForConditionalGeneration"]

    pipe = load_pipeline(root)
    assert isinstance(pipe.text_encoder, QwenVLTextEncoder)
    embeds, mask = pipe.text_encoder.encode(PROMPTS[:1])
    assert embeds.shape[-1] == 32 and mask.all()


def _states_around_final_norm(model, ids, mask):
    """(last decoder layer output, final norm output), each (B, T, D), captured by hooks."""
    lm = model.model.language_model
    cap = {}
    h1 = lm.layers[-1].register_forward_hook(
        lambda m, a, o: cap.__setitem__("pre", o[0] if isinstance(o, tuple) else o)
    )
    h2 = lm.norm.register_forward_hook(lambda m, a, o: cap.__setitem__("post", o))
    try:
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    finally:
        h1.remove(), h2.remove()
    return cap["pre"], cap["post"], out.hidden_states[-1]


def _select(hidden, mask, max_length=512):
    """What encode keeps of each prompt: its real tokens minus the template head."""
    return [h[m.bool()][QWEN_IMAGE_DROP_TOKENS:][:max_length] for h, m in zip(hidden, mask)]


def test_reads_the_state_after_the_final_norm(qwen_dirs):
    """Qwen-Image was trained on the language model's last hidden state after its final RMSNorm
    (transformers 4.53.1, the version its text encoder config records, appends the normed state
    as hidden_states[-1]); encode returns exactly that, not the last decoder layer's raw output."""
    root, _, _ = qwen_dirs
    enc = QwenVLTextEncoder.from_dirs(root / "text_encoder", root / "tokenizer", "cpu", torch.float32)
    embeds, mask = enc.encode(PROMPTS)
    tokens = enc.tokenizer(
        [QWEN_IMAGE_TEMPLATE.format(p) for p in PROMPTS], padding=True, return_tensors="pt"
    )
    pre, post, _ = _states_around_final_norm(enc.model, tokens.input_ids, tokens.attention_mask)
    for i, (p_post, p_pre) in enumerate(
        zip(_select(post, tokens.attention_mask), _select(pre, tokens.attention_mask))
    ):
        n = int(mask[i].sum())
        assert torch.allclose(embeds[i, :n], p_post, atol=1e-6)
        assert not torch.allclose(embeds[i, :n], p_pre, atol=1e-2)


def test_independent_of_what_hidden_states_minus_one_means(qwen_dirs):
    """transformers 5 lets a config untie hidden_states[-1] from last_hidden_state, making it the
    pre-norm state; the reference pipeline's embeddings then change, ours do not."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline

    root, _, _ = qwen_dirs
    enc = QwenVLTextEncoder.from_dirs(root / "text_encoder", root / "tokenizer", "cpu", torch.float32)
    before, mask = enc.encode(PROMPTS)
    lm_config = enc.model.model.language_model.config
    lm_config.tie_last_hidden_states = False
    tokens = enc.tokenizer(
        [QWEN_IMAGE_TEMPLATE.format(p) for p in PROMPTS], padding=True, return_tensors="pt"
    )
    pre, post, last = _states_around_final_norm(enc.model, tokens.input_ids, tokens.attention_mask)
    if not torch.equal(last, pre):
        pytest.skip("this transformers version has no tie_last_hidden_states switch")
    after, after_mask = enc.encode(PROMPTS)
    assert torch.equal(after, before) and torch.equal(after_mask, mask)
    pipe = QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(), vae=None, text_encoder=enc.model, tokenizer=enc.tokenizer,
        transformer=None,
    )  # fmt: skip
    with torch.no_grad():
        ref, _ = pipe.encode_prompt(PROMPTS, device="cpu", max_sequence_length=512)
    assert (ref - before).abs().max().item() > 1e-2  # the reference now reads the pre-norm state
    lm_config.tie_last_hidden_states = True
    with torch.no_grad():
        ref, _ = pipe.encode_prompt(PROMPTS, device="cpu", max_sequence_length=512)
    assert (ref - before).abs().max().item() <= 1e-5
