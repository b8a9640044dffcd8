"""The tiny edit model's recipe (recipes/tiny/train_edit.py): the vocabulary it adds, the batches
it draws, a few fine-tuning steps, and the checkpoint it saves loading as an edit model."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from PIL import Image

from ditfleet.model import load_pipeline
from ditfleet.model.family import model_task
from ditfleet.model.generation.scheduler import SchedulerConfig
from ditfleet.model.loading.folder import TINY_MODEL_DIR
from ditfleet.model.qwen_image.transformer import QwenImageTransformer, TransformerConfig
from ditfleet.model.tiny.edits import INSTRUCTION_WORDS, apply_edit, sample_edits
from ditfleet.model.tiny.scenes import all_scenes, split_scenes
from ditfleet.model.tiny.text_encoder import TextEncoderConfig, TinyTextEncoder, WordTokenizer
from recipes.tiny.train import SCHEDULER_CONFIG, caption_vocabulary
from recipes.tiny.train_edit import (
    EditTrainConfig,
    SceneLatents,
    edit_batch,
    edit_forward,
    extend_vocabulary,
    load_text_model,
    save_edit_model,
    train_edit,
)


def _encoder(hidden: int = 16) -> TinyTextEncoder:
    tokenizer = WordTokenizer.from_words(caption_vocabulary())
    return TinyTextEncoder(TextEncoderConfig(vocab_size=len(tokenizer), hidden_size=hidden), tokenizer)


def test_the_instruction_words_join_the_vocabulary_and_every_caption_encodes_as_before():
    torch.manual_seed(0)
    encoder = _encoder().eval()
    extended = extend_vocabulary(encoder, INSTRUCTION_WORDS, seed=0).eval()
    assert len(extended.tokenizer) == len(encoder.tokenizer) + len(INSTRUCTION_WORDS)
    caption = ["a small red circle in the centre on a blue background"]
    with torch.no_grad():
        assert torch.equal(extended.encode(caption)[0], encoder.encode(caption)[0])
    ids, _ = extended.tokenize(["make the shape blue", "move the shape to the top left"], 32)
    assert not (ids == 1).any()  # no <unk>


def test_a_batch_pairs_each_source_s_row_with_its_edited_scene_s_row():
    scenes = all_scenes()
    # Row i's tokens all hold i: a batch's rows say which scenes they are.
    table = SceneLatents(
        128, 128, torch.arange(len(scenes), dtype=torch.float32).view(-1, 1, 1).expand(-1, 64, 64)
    )
    encoder = extend_vocabulary(_encoder(), INSTRUCTION_WORDS, seed=0)
    train = split_scenes()[0]
    batch = edit_batch(table, train, encoder, 12, EditTrainConfig().flow, torch.Generator().manual_seed(3))
    pairs = sample_edits(train, 12, torch.Generator().manual_seed(3))  # the same draw
    assert batch.sources[:, 0, 0].long().tolist() == [scenes.index(s) for s, _ in pairs]
    assert batch.targets[:, 0, 0].long().tolist() == [scenes.index(apply_edit(s, e)) for s, e in pairs]
    assert batch.weights.shape == (12, 64) and batch.ids.shape[0] == 12
    assert batch.weights.mean(dim=1).allclose(torch.ones(12))


def test_a_few_edit_steps_train_the_dit_on_the_target_tokens_only():
    torch.manual_seed(0)
    encoder = extend_vocabulary(_encoder(), INSTRUCTION_WORDS, seed=0)
    transformer = QwenImageTransformer(
        TransformerConfig(
            patch_size=2, in_channels=64, out_channels=16, num_layers=1, attention_head_dim=8,
            num_attention_heads=2, joint_attention_dim=16, axes_dims_rope=(2, 2, 4),
        )
    )  # fmt: skip
    tokens = torch.randn(3, 60, 64)
    text, mask = encoder.encode(["make the shape blue"] * 3)
    out = edit_forward(
        transformer, tokens, torch.randn(3, 60, 64), text, mask, torch.rand(3), (6, 10), (6, 10)
    )
    assert out.shape == (3, 60, 64)  # the target's tokens, not the source's
    latents = [
        SceneLatents(w, h, torch.randn(len(all_scenes()), (w // 16) * (h // 16), 64))
        for w, h in ((128, 128), (160, 96))
    ]
    before = [p.detach().clone() for p in transformer.parameters()]
    config = dataclasses.replace(EditTrainConfig().flow, steps=2, batch_size=4, warmup=1)
    trained, _ = train_edit(
        config, latents, split_scenes()[0], transformer, encoder, SchedulerConfig.from_dict(SCHEDULER_CONFIG),
        torch.Generator().manual_seed(0), log=lambda line: None,
    )  # fmt: skip
    after = list(trained.parameters())
    assert all(torch.isfinite(p).all() for p in after)
    assert any(not torch.equal(a, b) for a, b in zip(after, before))


@pytest.mark.slow
def test_the_recipe_s_checkpoint_loads_as_an_edit_model_sharing_the_tiny_vae(tmp_path):
    transformer, encoder, _ = load_text_model(TINY_MODEL_DIR)
    out = tmp_path / "edit"
    save_edit_model(out, transformer, extend_vocabulary(encoder, INSTRUCTION_WORDS, seed=0), TINY_MODEL_DIR)
    assert (out / "vae").is_symlink() and (out / "vae").resolve() == (TINY_MODEL_DIR / "vae").resolve()
    assert json.loads((out / "model_index.json").read_text())["_class_name"] == "QwenImageEditPlusPipeline"
    assert model_task(out) == "edit"
    pipe = load_pipeline(out)
    assert pipe.edit is not None and pipe.edit.vae_size(160, 96) == (160, 96)
    source = Image.new("RGB", (160, 96), (230, 31, 26))
    image = pipe.generate(
        prompt=["make the background blue"],
        sources=[[source]],
        height=96,
        width=160,
        steps=2,
        true_cfg_scale=2.0,
        seeds=[0],
    )
    assert image.shape == (1, 3, 96, 160) and torch.isfinite(image).all()
    # Saved again over itself (a rerun of the recipe), the link is replaced, not followed.
    save_edit_model(out, transformer, extend_vocabulary(encoder, INSTRUCTION_WORDS, seed=0), TINY_MODEL_DIR)
    assert (out / "vae").is_symlink() and (TINY_MODEL_DIR / "vae" / "config.json").is_file()
