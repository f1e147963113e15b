"""Tiny MMFusion configs and inputs built in code (transformers' ModelTester sizes) and the output shapes to expect."""

import torch
from transformers import BertConfig, ConvNextConfig, MobileNetV2Config, ResNetConfig, ViTConfig

from mm_fusion import MMFusionConfig


FUSION_TYPES = ["hierarchical", "cross_attention", "late"]


class MMFusionModelTester:
    """Builds tiny configs (hidden 32, 2 layers, 4 heads, image 30, patch 2, vocab 99) and matching inputs."""

    batch_size = 3
    seq_length = 7
    vocab_size = 99
    image_size = 30
    num_labels = 5

    def vision_config(self, **kwargs) -> ViTConfig:
        args = dict(
            image_size=self.image_size,
            patch_size=2,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=37,
            hidden_dropout_prob=0.1,
            attention_probs_dropout_prob=0.1,
        )
        return ViTConfig(**{**args, **kwargs})

    def resnet_config(self, **kwargs) -> ResNetConfig:
        """A backbone tower: stem (8x8 at 30 px), stage1 (8x8, 8 channels), stage2 (4x4, 16 channels)."""
        args = dict(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic")
        return ResNetConfig(**{**args, **kwargs})

    def convnext_config(self, **kwargs) -> ConvNextConfig:
        """A backbone tower with norms on its feature maps: 4x4 patchify stem, stages of 8, 16 and 16 channels."""
        args = dict(num_stages=3, hidden_sizes=[8, 16, 16], depths=[1, 1, 1], image_size=self.image_size)
        return ConvNextConfig(**{**args, **kwargs})

    def mobilenet_config(self, **kwargs) -> MobileNetV2Config:
        """A convolutional model without a backbone class: its 16 `hidden_states` maps are the stages."""
        return MobileNetV2Config(**{**dict(depth_multiplier=0.35, image_size=self.image_size), **kwargs})

    def text_config(self, **kwargs) -> BertConfig:
        args = dict(
            vocab_size=self.vocab_size,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=37,
            max_position_embeddings=64,
            hidden_dropout_prob=0.1,
            attention_probs_dropout_prob=0.1,
        )
        return BertConfig(**{**args, **kwargs})

    def config(self, fusion_type: str = "hierarchical", **kwargs) -> MMFusionConfig:
        args = dict(
            vision_config=self.vision_config(),
            text_config=self.text_config(),
            fusion_type=fusion_type,
            num_fusion_layers=2,
            projection_dim=16,
            num_labels=self.num_labels,
        )
        return MMFusionConfig(**{**args, **kwargs})

    def inputs(self, batch_size: int | None = None, seed: int = 0) -> dict[str, torch.Tensor]:
        """Random images and texts of different lengths, right-padded with id 0, as a tokenizer would give."""
        batch_size = batch_size or self.batch_size
        g = torch.Generator().manual_seed(seed)
        input_ids = torch.randint(1, self.vocab_size, (batch_size, self.seq_length), generator=g)
        lengths = torch.randint(2, self.seq_length + 1, (batch_size,), generator=g)
        lengths[0] = self.seq_length
        attention_mask = (torch.arange(self.seq_length)[None, :] < lengths[:, None]).long()
        input_ids = input_ids * attention_mask
        pixel_values = torch.randn(batch_size, 3, self.image_size, self.image_size, generator=g)
        return {"pixel_values": pixel_values, "input_ids": input_ids, "attention_mask": attention_mask}


def expected_output_shapes(
    B: int, T: int, P: int, D: int, H: int, L: int, fusion_type: str, fusion_direction: str
) -> dict[str, tuple[int, tuple[int, ...]] | None]:
    """
    For each hidden-state / attention field of an MMFusion output: (number of entries, shape of each), or None when
    the fusion type does not return it. B texts (one image each), T tokens, P image tokens, width D, H heads, L layers
    in both towers and the fusion block.
    """
    fused = fusion_type != "late"
    both_ways = fused and fusion_direction == "bidirectional"
    return {
        "text_hidden_states": (L + 1, (B, T, D)),
        "vision_hidden_states": (L + 1, (B, P, D)),
        "fusion_text_hidden_states": (L + 1, (B, T, D)) if fused else None,
        "fusion_image_hidden_states": (L + 1, (B, P, D)) if fused else None,
        "text_attentions": (L, (B, H, T, T)),
        "vision_attentions": (L, (B, H, P, P)),
        "fusion_text_self_attentions": (L, (B, H, T, T)) if fused else None,
        "text_to_image_attentions": (L, (B, H, T, P)) if fused else None,
        "fusion_image_self_attentions": (L, (B, H, P, P)) if both_ways else None,
        "image_to_text_attentions": (L, (B, H, P, T)) if both_ways else None,
    }
