"""Processor for MMFusion models: one image processor and one tokenizer behind a single call."""

from transformers import BatchFeature, ProcessorMixin

from .image_processing_mm_fusion import as_image_list


class MMFusionProcessor(ProcessorMixin):
    r"""
    Composes an image processor ([`MMFusionImageProcessor`], which gives the training cache's uint8 pixels; any
    transformers image processor also works) and a tokenizer. Calling it with `images` and `text` returns a
    [`BatchFeature`] with `pixel_values`, `input_ids` and `attention_mask`; `save_pretrained` writes both parts and
    `AutoProcessor.from_pretrained` reads them back.

    Args:
        image_processor ([`BaseImageProcessor`]):
            Turns images into `pixel_values`.
        tokenizer ([`PreTrainedTokenizerBase`]):
            Turns text into `input_ids` / `attention_mask`.
        max_length (`int`, *optional*):
            Texts are truncated to this many tokens, as they were in training (`scripts/train.py` saves its
            `--max_length` here). Defaults to the tokenizer's `model_max_length`.

    Example:

    ```python
    >>> from PIL import Image
    >>> from mm_fusion import MMFusionImageProcessor, MMFusionProcessor, train_tokenizer

    >>> tokenizer = train_tokenizer(["what color is the circle?", "is there a square?"], vocab_size=100)
    >>> processor = MMFusionProcessor(MMFusionImageProcessor(size={"height": 64, "width": 64}), tokenizer)
    >>> batch = processor(images=[Image.new("RGB", (64, 64))], text=["is there a square?"])
    >>> sorted(batch.keys())
    ['attention_mask', 'input_ids', 'pixel_values']
    ```
    """

    def __init__(self, image_processor=None, tokenizer=None, max_length: int | None = None, **kwargs):
        self.max_length = max_length
        super().__init__(image_processor, tokenizer, **kwargs)

    def __call__(
        self,
        images=None,
        text: str | list[str] | None = None,
        padding: bool | str = True,
        truncation: bool = True,
        max_length: int | None = None,
        return_tensors: str | None = "pt",
        **kwargs,
    ) -> BatchFeature:
        """
        `images` (one or a list) and / or `text` (one or a list), paired one to one when both are given. Texts are
        padded to the longest and truncated to `max_length` (the training length saved with the processor) unless
        told otherwise; other keyword arguments go to the tokenizer.
        """
        if images is None and text is None:
            raise ValueError("MMFusionProcessor needs `images`, `text` or both.")
        self.validate_inputs(images=images, text=text)
        data = {}
        if images is not None:
            data.update(self.image_processor(images, return_tensors=return_tensors))
        if text is not None:
            max_length = max_length or self.max_length
            encoded = self.tokenizer(
                text,
                padding=padding,
                truncation=truncation,
                max_length=max_length,
                return_tensors=return_tensors,
                **kwargs,
            )
            data.update(encoded)
        return BatchFeature(data)

    def validate_inputs(self, images=None, text=None, videos=None, audio=None, **kwargs):
        super().validate_inputs(images=images, text=text, videos=videos, audio=audio, **kwargs)
        if images is not None and text is not None:
            num_images = len(as_image_list(images))
            num_texts = 1 if isinstance(text, str) else len(text)
            if num_images != num_texts:
                raise ValueError(
                    f"Got {num_images} images and {num_texts} texts; MMFusionProcessor pairs them one to one, so "
                    "their counts must match."
                )

    @property
    def model_input_names(self) -> list[str]:
        names = list(self.tokenizer.model_input_names) if self.tokenizer is not None else []
        return names + ["pixel_values"]


__all__ = ["MMFusionProcessor"]
