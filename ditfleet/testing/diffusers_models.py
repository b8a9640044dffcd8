"""Toy-width random checkpoints of diffusers pipelines without a native family, built with
diffusers' own classes and saved by `save_pretrained` (tests and bench/; needs the `test` extra).

Nothing is downloaded: the tokenizers are word-level vocabularies made here with the `tokenizers`
library and wrapped as transformers' PreTrainedTokenizerFast.
"""

from __future__ import annotations

from pathlib import Path

import torch

# Every word the toy prompts use (tests/support/worker_fixtures.py, compile.warmup's prompts);
# anything else is the unknown token, which is still a valid input.
WORDS = (
    "a an the small big red green blue yellow black white circle square triangle at top bottom left "
    "right on of in background fox fresh snow"
).split()


def _word_tokenizer(specials: list[str], **tokens: str):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {s: i for i, s in enumerate(specials)}
    for word in WORDS:
        vocab.setdefault(word, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab, unk_token=tokens["unk_token"]))
    backend.normalizer = normalizers.Lowercase()
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, **tokens)


def _clip(seed: int):
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(seed)
    config = CLIPTextConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        projection_dim=16, max_position_embeddings=77, bos_token_id=0, eos_token_id=1, pad_token_id=1,
    )  # fmt: skip
    tokenizer = _word_tokenizer(
        ["<|startoftext|>", "<|endoftext|>"], unk_token="<|endoftext|>", bos_token="<|startoftext|>",
        eos_token="<|endoftext|>", pad_token="<|endoftext|>", model_max_length=77,
    )  # fmt: skip
    return CLIPTextModel(config), tokenizer


def _t5(seed: int):
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(seed)
    config = T5Config(
        vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2, relative_attention_num_buckets=8
    )  # fmt: skip
    tokenizer = _word_tokenizer(
        ["<pad>", "</s>", "<unk>"],
        unk_token="<unk>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=32,
    )
    return T5EncoderModel(config), tokenizer


def _vae(seed: int, latent_channels: int):
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    return AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 2,
        up_block_types=["UpDecoderBlock2D"] * 2, block_out_channels=[8, 8], layers_per_block=1,
        latent_channels=latent_channels, norm_num_groups=4, sample_size=32, shift_factor=0.0, scaling_factor=1.0,
    )  # fmt: skip


def make_flux_dir(root: Path, seed: int = 0) -> Path:
    """A FluxPipeline checkpoint (FLUX.1's classes at toy widths): CLIP + T5, one double and one
    single block, 2x VAE downsampling (sizes multiples of 4)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    clip, clip_tokenizer = _clip(seed)
    t5, t5_tokenizer = _t5(seed + 1)
    torch.manual_seed(seed + 2)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=16, pooled_projection_dim=16, axes_dims_rope=(2, 2, 4),
        guidance_embeds=True,  # as FLUX.1-dev: the guidance scale is an input, so a test sees it
    )  # fmt: skip
    pipe = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(), vae=_vae(seed + 3, 4), text_encoder=clip,
        tokenizer=clip_tokenizer, text_encoder_2=t5, tokenizer_2=t5_tokenizer, transformer=transformer,
    )  # fmt: skip
    pipe.save_pretrained(root)
    return root


def make_sd3_dir(root: Path, seed: int = 0, img2img: bool = False) -> Path:
    """A StableDiffusion3Pipeline checkpoint (SD3.5's classes at toy widths): two CLIPs with
    projections + T5, one joint block. img2img: the same components as a
    StableDiffusion3Img2ImgPipeline (an edit checkpoint: its `__call__` takes an image)."""
    import diffusers
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from transformers import CLIPTextModelWithProjection

    encoders = []
    for i in range(2):
        _, tokenizer = _clip(seed + i)
        torch.manual_seed(seed + i)
        model = CLIPTextModelWithProjection(_clip(seed + i)[0].config)
        encoders.append((model, tokenizer))
    t5, t5_tokenizer = _t5(seed + 2)
    torch.manual_seed(seed + 3)
    transformer = SD3Transformer2DModel(
        sample_size=32, patch_size=1, in_channels=4, num_layers=1, attention_head_dim=8, num_attention_heads=2,
        caption_projection_dim=16, joint_attention_dim=16, pooled_projection_dim=32, out_channels=4,
    )  # fmt: skip
    cls = diffusers.StableDiffusion3Img2ImgPipeline if img2img else diffusers.StableDiffusion3Pipeline
    pipe = cls(
        scheduler=FlowMatchEulerDiscreteScheduler(), vae=_vae(seed + 4, 4),
        text_encoder=encoders[0][0], tokenizer=encoders[0][1], text_encoder_2=encoders[1][0],
        tokenizer_2=encoders[1][1], text_encoder_3=t5, tokenizer_3=t5_tokenizer, transformer=transformer,
    )  # fmt: skip
    pipe.save_pretrained(root)
    return root
