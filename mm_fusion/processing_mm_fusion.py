"""Processor for MMFusion models: one image processor and one tokenizer behind a single call."""

from transformers import ProcessorMixin
from transformers.image_utils import make_flat_list_of_images


class MMFusionProcessor(ProcessorMixin):
    r"""
    Composes an image processor (e.g. `ViTImageProcessor`) and a tokenizer. Calling it with `images` and `text`
    returns a [`BatchFeature`] with `pixel_values`, `input_ids` and `attention_mask`; `save_pretrained` writes both
    parts and `AutoProcessor.from_pretrained` reads them back.

    Args:
        image_processor ([`BaseImageProcessor`]):
            Turns images into `pixel_values`.
        tokenizer ([`PreTrainedTokenizerBase`]):
            Turns text into `input_ids` / `attention_mask`.

    Example:

    ```python
    >>> from PIL import Image
    >>> from transformers import ViTImageProcessor
    >>> from mm_fusion import MMFusionProcessor, train_tokenizer

    >>> tokenizer = train_tokenizer(["what color is the circle?", "is there a square?"], vocab_size=100)
    >>> processor = MMFusionProcessor(ViTImageProcessor(size={"height": 64, "width": 64}), tokenizer)
    >>> batch = processor(images=[Image.new("RGB", (64, 64))], text=["is there a square?"], return_tensors="pt")
    >>> sorted(batch.keys())
    ['attention_mask', 'input_ids', 'pixel_values']
    ```
    """

    def __init__(self, image_processor=None, tokenizer=None, **kwargs):
        super().__init__(image_processor, tokenizer, **kwargs)

    def validate_inputs(self, images=None, text=None, videos=None, audio=None, **kwargs):
        super().validate_inputs(images=images, text=text, videos=videos, audio=audio, **kwargs)
        if images is not None and text is not None:
            num_images = len(make_flat_list_of_images(images))
            num_texts = 1 if isinstance(text, str) else len(text)
            if num_images != num_texts:
                raise ValueError(
                    f"Got {num_images} images and {num_texts} texts; MMFusionProcessor pairs them one to one, so "
                    "their counts must match."
                )


__all__ = ["MMFusionProcessor"]
