"""
The training FLOPs of an MMFusion model's batch, for Trainer's `total_flos` and the MFU estimate: a mixin of
`MMFusionPreTrainedModel` (Trainer's default counts only the text tokens). Imported by `modeling_mm_fusion.py` with a
relative import, so a saved directory carries it for `trust_remote_code` loading.
"""

import copy

import torch


class MMFusionFlopsMixin:
    """`floating_point_ops` for a model with a vision tower and a text tower; mixed into a `PreTrainedModel`."""

    def floating_point_ops(self, input_dict: dict, exclude_embeddings: bool = True) -> int:
        """
        Training FLOPs of one batch, for Trainer's `total_flos` and the MFU estimate (Trainer's default counts only
        the text tokens): 6 x the multiply-accumulates of the forward (2 FLOPs each, and the backward twice the
        forward), per part of the model.

        - A transformer vision tower: 6 x parameters x tokens, per part: the vision tower over the patches of each
          distinct image, the text tower over the text tokens, the rest over every fused pair.
        - A backbone / convolutional tower reuses each weight at every position of a feature map, so its cost is no
          parameter count times tokens: the bare model's forward FLOPs per image, per pair and per text token are
          measured once per image shape ([`_flop_rates`]), and the heads add 2 x their parameters per pair. With a
          tower conditioned on each text (`vision_text_attention`, `vision_film`) the stem and the stages up to the
          first conditioned one count once per distinct image and the rest of the tower, with the stages' reads of
          the text, once per text. The pretraining head's second fusion pass (image-text matching with hard
          negatives) is not counted.
        """
        pixel_values, input_ids = input_dict.get("pixel_values"), input_dict.get("input_ids")
        if pixel_values is None or input_ids is None:
            return super().floating_point_ops(input_dict, exclude_embeddings)
        mask = input_dict.get("attention_mask")
        tokens = int(mask.sum()) if mask is not None else input_ids.numel()
        pairs = input_ids.shape[0]
        config = self.config
        conditioned = config.vision_film or config.vision_text_attention
        if config.vision_tower_type != "transformer":  # no walk over the parameters: Trainer asks every step
            per_image, per_pair, per_token = self._flop_rates(tuple(pixel_values.shape[1:]))
            # A conditioned tower runs on the distinct images only when texts share them (`image_index`).
            images = min(len(pixel_values), pairs) if conditioned else len(pixel_values)
            embeddings = 0
            if not exclude_embeddings:
                embeddings = self._flop_parameter_counts(False)[1] - self._flop_parameter_counts(True)[1]
            return 3 * (per_image * images + per_pair * pairs + per_token * tokens) + 6 * embeddings * tokens
        vision, text, rest = self._flop_parameter_counts(exclude_embeddings)
        patches = (pixel_values.shape[-1] // getattr(config.vision_config, "patch_size", 16)) ** 2 + 1
        images = pairs if conditioned else pixel_values.shape[0]  # a tower conditioned on the text: one per text
        return 6 * (vision * images * patches + text * tokens + rest * (tokens + pairs * patches))

    def _flop_rates(self, image_shape: tuple[int, ...]) -> tuple[int, int, int]:
        """
        Forward FLOPs per image, per image-text pair and per text token, at this `(channels, height, width)`, of a
        model with a backbone / convolutional tower: the bare model's, counted by `FlopCounterMode` (convolutions,
        matrix products, attention) on a copy built on the meta device (no memory, no compute) for 1 image with 1
        text of 1 token, 2 texts of 1 token and 1 text of 2 tokens, plus 2 x the heads' parameters per pair. Cached
        per shape. Linear in the text length: the texts' self-attention (quadratic in it) and the stage reads' way of
        computing (chosen by it) put the default model within 4% of a count at the real length, up to 64 tokens.
        """
        rates = self.__dict__.setdefault("_flop_rates_by_shape", {})
        if image_shape not in rates:
            from torch.utils.flop_counter import FlopCounterMode

            bare_class = type(getattr(self, self.base_model_prefix, self))  # MMFusionModel
            with torch.device("meta"):
                bare = bare_class(copy.deepcopy(self.config), add_projection_layers=False).eval()

            def forward_flops(texts: int, length: int) -> int:
                inputs = {
                    "pixel_values": torch.empty(1, *image_shape, device="meta"),
                    "input_ids": torch.zeros(texts, length, dtype=torch.long, device="meta"),
                    "image_index": torch.zeros(texts, dtype=torch.long),  # on the CPU: the forward checks its values
                }
                with FlopCounterMode(display=False) as counter:
                    bare(**inputs)
                return counter.get_total_flops()

            one = forward_flops(1, 1)
            per_token = forward_flops(1, 2) - one
            per_pair = forward_flops(2, 1) - one - per_token
            base = getattr(self, self.base_model_prefix, self)
            heads = self.num_parameters(exclude_embeddings=True) - base.num_parameters(exclude_embeddings=True)
            rates[image_shape] = (one - per_pair - per_token, per_pair + 2 * heads, per_token)
        return rates[image_shape]

    def _flop_parameter_counts(self, exclude_embeddings: bool) -> tuple[int, int, int]:
        """Parameters of the vision tower, the text tower and the rest; counted once per model size (Trainer asks
        for the FLOPs of every step, and counting walks every module)."""
        size = sum(p.numel() for p in self.parameters())  # changes with resize_token_embeddings and the like
        cached = getattr(self, "_flop_counts", {}).get(exclude_embeddings)
        if cached is None or cached[0] != size:
            base = getattr(self, self.base_model_prefix, self)
            vision = base.vision_model.num_parameters(exclude_embeddings=exclude_embeddings)
            text = base.text_model.num_parameters(exclude_embeddings=exclude_embeddings)
            rest = self.num_parameters(exclude_embeddings=exclude_embeddings) - vision - text
            cached = (size, vision, text, rest)
            self.__dict__.setdefault("_flop_counts", {})[exclude_embeddings] = cached
        return cached[1:]
