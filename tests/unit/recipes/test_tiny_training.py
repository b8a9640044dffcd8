"""The tiny model's training recipe: the shape-weighted DiT loss, the centred pools, the
data-parallel helpers, and the whole script for a few steps of each stage (deterministic, so the
recipe that made model/tiny/weights still runs end to end)."""

import functools
import json

import pytest
import torch

from ditfleet.model import load_pipeline
from ditfleet.model.generation.sampling import pack_latents
from ditfleet.model.qwen_image.vae import QwenImageVAE, VAEConfig
from ditfleet.model.tiny.scenes import Scene, render_batch, split_scenes
from ditfleet.model.tiny.text_encoder import TextEncoderConfig, TinyTextEncoder, WordTokenizer
from recipes.tiny.data_parallel import Shard, run_data_parallel
from recipes.tiny.train import caption_vocabulary
from recipes.tiny.train_dit import DiTTrainConfig, build_centred_pools, shape_token_weights


def test_shape_token_weights_mark_the_tokens_under_the_shape():
    scene = Scene("square", "red", "blue", "top left", "small")
    image = render_batch([scene], 128, 128)  # shape centred at (21.3, 21.3), half-extent 12.8 px
    weights = shape_token_weights(image, shape_weight=8.0)
    assert weights.shape == (1, 64)
    assert weights.mean().item() == pytest.approx(1.0)
    grid = weights.view(8, 8)
    # The square spans pixels 8.5..34.1 in x and y: token rows/cols 0..2 hold it, the rest is background.
    touched = grid > 1.0
    assert touched[:3, :3].all() and not touched[3:, :].any() and not touched[:, 3:].any()
    assert grid[0, 0].item() == pytest.approx(8.0 * grid[7, 7].item())
    # Token order is pack_latents' order: a latent laid out like the weights packs to the same index.
    marker = torch.zeros(1, 16, 16, 16)
    marker[:, :, 0:2, 2:4] = 1.0  # token row 0, col 1
    assert int(pack_latents(marker)[0].sum(dim=1).argmax()) == 1


def test_shape_token_weights_of_one_are_uniform():
    images = render_batch([Scene("circle", "red", "blue", "centre", "large")], 160, 96)
    assert torch.equal(shape_token_weights(images, 1.0), torch.ones(1, 60))


@pytest.mark.slow
def test_centred_pools_hold_each_scene_once_and_split_over_processes():
    vae = QwenImageVAE(
        VAEConfig(base_dim=8, num_res_blocks=1, latents_mean=(0.0,) * 16, latents_std=(1.0,) * 16)
    ).eval()
    tokenizer = WordTokenizer.from_words(caption_vocabulary())
    encoder = TinyTextEncoder(TextEncoderConfig(vocab_size=len(tokenizer), hidden_size=16), tokenizer)
    scenes = split_scenes()[0][:10]
    config = DiTTrainConfig(pool_per_bucket=8)
    halves = [build_centred_pools(vae, encoder, scenes, config, Shard(rank, 2)) for rank in (0, 1)]
    whole = build_centred_pools(vae, encoder, scenes, config)
    for bucket in range(3):
        ids = [tuple(row) for h in halves for row in h[bucket].ids.tolist()]
        assert len(ids) == 8 and len(set(ids)) == 8  # 8 distinct scenes, none in both halves
        assert sorted(ids) == sorted(tuple(row) for row in whole[bucket].ids.tolist())
        assert (
            halves[0][bucket].tokens.shape[0] == 4
            and whole[bucket].weights.shape == whole[bucket].tokens.shape[:2]
        )


def test_shard_part_names_what_does_not_split():
    assert Shard(0, 2).part(48, "DiT batch size") == 24
    with pytest.raises(ValueError, match="DiT batch size 47 does not split over 2 training processes"):
        Shard(1, 2).part(47, "DiT batch size")


def _average_in_process(out_dir, shard: Shard) -> None:
    param = torch.nn.Parameter(torch.zeros(3))
    param.grad = torch.full((3,), float(shard.rank + 1))
    shard.average_gradients([param])
    value = shard.broadcast(torch.tensor([float(shard.rank) + 7.0]))
    torch.save((param.grad, value), f"{out_dir}/rank{shard.rank}.pt")


@pytest.mark.slow
def test_two_processes_average_gradients_and_share_process_0s_values(tmp_path):
    run_data_parallel(2, functools.partial(_average_in_process, str(tmp_path)))
    for rank in (0, 1):
        grad, value = torch.load(tmp_path / f"rank{rank}.pt")
        assert torch.equal(grad, torch.full((3,), 1.5)) and value.item() == 7.0


@pytest.mark.slow
def test_run_data_parallel_raises_what_a_process_raised():
    with pytest.raises(Exception, match="DiT batch size 7 does not split"):
        run_data_parallel(2, _split_seven)


def _split_seven(shard: Shard) -> None:
    shard.part(7, "DiT batch size")


@pytest.mark.slow
def test_training_script_runs_end_to_end_and_is_deterministic(tmp_path):
    from safetensors.torch import load_file

    from recipes.tiny.train import DECODER_ADAPTATION_FILE, main

    def weights(run: str, part: str) -> dict[str, torch.Tensor]:
        return load_file(str(tmp_path / run / part / "diffusion_pytorch_model.safetensors"))

    def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    # Both DiT phases run (jittered shapes for 2 steps, then centred ones) and the decoder
    # adaptation, in two data-parallel processes as the default recipe does: their all-reduced
    # gradients must be deterministic too. A smaller DiT than the recipe's keeps it quick and
    # checks that the size flags reach the model.
    args = (
        "--vae-steps 2 --vae-stats-images 12 --dit-steps 4 --dit-centre-from 2 --pool-per-bucket 8 --processes 2"
        " --dit-heads 2 --dit-layers 2 --dit-batch 8 --decoder-steps 2 --decoder-pairs 4"
    ).split()
    main(["--out", str(tmp_path / "a"), *args])
    # Stages 1-2 alone, then stage 3 on their saved model: the same weights as straight through.
    main(["--out", str(tmp_path / "b"), *args, "--decoder-steps", "0"])
    main(["--out", str(tmp_path / "c"), *args, "--stage2", str(tmp_path / "b")])
    # Reusing a's VAE skips the VAE stage and still gives the same DiT (the DiT learns from the
    # encoder alone); its adapted decoder comes along with its record.
    main(["--out", str(tmp_path / "d"), *args, "--decoder-steps", "0", "--vae", str(tmp_path / "a" / "vae")])
    for run in ("b", "c", "d"):
        assert same(weights("a", "transformer"), weights(run, "transformer")), run
    assert same(weights("a", "vae"), weights("c", "vae"))
    # Stage 3 changed the decoder and nothing the DiT learned from: the encoder is stage 1's.
    adapted, plain = weights("a", "vae"), weights("b", "vae")
    decoder_keys = [k for k in plain if k.startswith(("decoder.", "post_quant_conv."))]
    assert decoder_keys and not all(torch.equal(adapted[k], plain[k]) for k in decoder_keys)
    assert all(torch.equal(adapted[k], plain[k]) for k in plain if k not in decoder_keys)
    assert (tmp_path / "a" / "vae" / DECODER_ADAPTATION_FILE).is_file()
    assert not (tmp_path / "b" / "vae" / DECODER_ADAPTATION_FILE).exists()
    assert (tmp_path / "d" / "vae" / DECODER_ADAPTATION_FILE).is_file()
    config = json.loads((tmp_path / "a" / "transformer" / "config.json").read_text())
    assert (config["num_attention_heads"], config["num_layers"]) == (2, 2), config
    assert "total training time" in (tmp_path / "a" / "train_log.txt").read_text()
    assert "stages 1-2 taken from" in (tmp_path / "c" / "train_log.txt").read_text()
    assert "vae loaded from" in (tmp_path / "d" / "train_log.txt").read_text()
    pipe = load_pipeline(tmp_path / "a")
    image = pipe.generate(
        prompt=["a small red circle in the centre on a blue background"],
        height=96,
        width=160,
        steps=2,
        seeds=[0],
    )
    assert image.shape == (1, 3, 96, 160) and torch.isfinite(image).all()


def test_training_refuses_to_adapt_an_adapted_decoder_again(tmp_path, capsys):
    from recipes.tiny.train import DECODER_ADAPTATION_FILE, main

    model = tmp_path / "model"
    (model / "transformer").mkdir(parents=True)
    (model / "transformer" / "config.json").write_text("{}")
    (model / "vae").mkdir()
    (model / "vae" / "config.json").write_text("{}")
    (model / "vae" / DECODER_ADAPTATION_FILE).write_text("{}")
    for extra in (["--stage2", str(model)], ["--vae", str(model / "vae")]):
        with pytest.raises(SystemExit):
            main(["--out", str(tmp_path / "out"), *extra])
        assert "already adapted" in capsys.readouterr().err, extra
