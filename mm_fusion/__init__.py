"""mm_fusion: image-text fusion models for the Hugging Face ecosystem."""

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForPreTraining,
    AutoModelForVisualQuestionAnswering,
    AutoProcessor,
)

from .configuration_mm_fusion import MMFusionConfig
from .modeling_mm_fusion import (
    MMFusionForImageTextClassification,
    MMFusionForPretraining,
    MMFusionModel,
    MMFusionPreTrainedModel,
)
from .processing_mm_fusion import MMFusionProcessor
from .tokenizer_training import train_tokenizer


__version__ = "0.1.0"

# Registration, all in one place: the Auto classes find MMFusion by `model_type`, and `register_for_auto_class` makes
# `save_pretrained` copy the code next to the weights so a directory loads with `trust_remote_code=True` alone.
AutoConfig.register(MMFusionConfig.model_type, MMFusionConfig, exist_ok=True)
AutoModel.register(MMFusionConfig, MMFusionModel, exist_ok=True)
AutoModelForPreTraining.register(MMFusionConfig, MMFusionForPretraining, exist_ok=True)
AutoModelForVisualQuestionAnswering.register(MMFusionConfig, MMFusionForImageTextClassification, exist_ok=True)
AutoProcessor.register(MMFusionConfig, MMFusionProcessor, exist_ok=True)

MMFusionConfig.register_for_auto_class()
MMFusionModel.register_for_auto_class("AutoModel")
MMFusionForPretraining.register_for_auto_class("AutoModelForPreTraining")
MMFusionForImageTextClassification.register_for_auto_class("AutoModelForVisualQuestionAnswering")
MMFusionProcessor.register_for_auto_class("AutoProcessor")

__all__ = [
    "MMFusionConfig",
    "MMFusionForImageTextClassification",
    "MMFusionForPretraining",
    "MMFusionModel",
    "MMFusionPreTrainedModel",
    "MMFusionProcessor",
    "train_tokenizer",
]
