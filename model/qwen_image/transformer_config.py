"""The transformer's config.json as a frozen dataclass, without torch (`model.memory` reads it)."""

from __future__ import annotations

from dataclasses import dataclass, fields

from ditfleet.model.loading.folder import drop_ignored_keys

# Keys of published transformer configs that diffusers' QwenImageTransformer2DModel does not take.
IGNORED_KEYS = {
    "pooled_projection_dim": "a Flux-era key; Qwen-Image has no pooled text projection (diffusers ignores it)",
}
DIFFUSERS_CLASS = "QwenImageTransformer2DModel"


@dataclass(frozen=True)
class TransformerConfig:
    """The keys of diffusers' transformer/config.json that shape the model."""

    patch_size: int = 2
    in_channels: int = 64
    out_channels: int | None = 16
    num_layers: int = 60
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 3584
    guidance_embeds: bool = False
    axes_dims_rope: tuple[int, int, int] = (16, 56, 56)
    zero_cond_t: bool = False
    use_additional_t_cond: bool = False
    use_layer3d_rope: bool = False

    def __post_init__(self) -> None:
        if sum(self.axes_dims_rope) != self.attention_head_dim:
            raise ValueError(
                f"axes_dims_rope {tuple(self.axes_dims_rope)} must sum to attention_head_dim {self.attention_head_dim}"
            )
        # zero_cond_t (Qwen-Image-Edit-2511) is supported: model.qwen_image.transformer.SplitModulation.
        unsupported = [n for n in ("guidance_embeds", "use_layer3d_rope") if getattr(self, n)]
        if unsupported:
            raise ValueError(
                f"transformer config: {unsupported} are layered/guidance-distilled variants, not supported"
            )

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @classmethod
    def from_dict(cls, d: dict, where: str = "transformer/config.json") -> TransformerConfig:
        cls_name = d.get("_class_name", DIFFUSERS_CLASS)
        if cls_name != DIFFUSERS_CLASS:
            raise ValueError(
                f"{where}: _class_name is {cls_name!r}; expected {DIFFUSERS_CLASS!r} (a Qwen-Image transformer). "
                "Point the model path at a Qwen-Image checkpoint."
            )
        d = drop_ignored_keys(d, IGNORED_KEYS, "transformer")
        known = {f.name for f in fields(cls)}
        unknown = sorted(k for k in d if not k.startswith("_") and k not in known)
        if unknown:
            raise ValueError(
                f"{where}: unknown keys {unknown}; they may change the model, so they are refused. "
                "Is this a Qwen-Image transformer config?"
            )
        kwargs = {k: v for k, v in d.items() if k in known}
        if "axes_dims_rope" in kwargs:
            kwargs["axes_dims_rope"] = tuple(kwargs["axes_dims_rope"])
        try:
            return cls(**kwargs)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from e

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["axes_dims_rope"] = list(self.axes_dims_rope)
        return {"_class_name": "QwenImageTransformer2DModel", **d}
