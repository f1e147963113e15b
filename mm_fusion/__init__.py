"""mm_fusion: image-text fusion models for the Hugging Face ecosystem."""

from transformers import (
    AutoConfig,
    AutoImageProcessor,
    AutoModel,
    AutoModelForPreTraining,
    AutoModelForVisualQuestionAnswering,
    AutoModelForZeroShotImageClassification,
    AutoProcessor,
)
from transformers.pipelines import PIPELINE_REGISTRY

from .configuration_mm_fusion import MMFusionConfig
from .head_check import MissingHeadError, ZeroShotLoader, pipeline_loader
from .image_processing_mm_fusion import MMFusionImageProcessor
from .model_paths import check_model_path
from .modeling_mm_fusion import (
    MMFusionForImageTextClassification,
    MMFusionForPretraining,
    MMFusionModel,
    MMFusionPreTrainedModel,
    MMFusionPretrainingLoss,
)
from .onnx_model import MMFusionOnnxModel
from .pipeline_mm_fusion import (
    PIPELINE_TASKS,
    CachedZeroShotImageClassificationPipeline,
    ImageTextClassificationPipeline,
    ImageTextMatchingPipeline,
    ImageTextRetrievalPipeline,
    RetrievalIndex,
    UnknownWordsWarning,
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
# The zero-shot Auto class has no fine-tuning use: it loads MMFusionForPretraining through ZeroShotLoader, which
# refuses a checkpoint saved with another head (transformers' own zero-shot pipeline would serve it from fresh layers).
AutoModelForZeroShotImageClassification.register(MMFusionConfig, ZeroShotLoader, exist_ok=True)
# One image processor for both backends: it must resize exactly as the training cache did (with PIL), so a
# torchvision variant would not give the same pixels; registered for both, transformers does not warn of a fallback.
AutoImageProcessor.register(
    MMFusionConfig,
    image_processor_classes={"pil": MMFusionImageProcessor, "torchvision": MMFusionImageProcessor},
    exist_ok=True,
)
AutoProcessor.register(MMFusionConfig, MMFusionProcessor, exist_ok=True)

MMFusionConfig.register_for_auto_class()
MMFusionModel.register_for_auto_class("AutoModel")
MMFusionForPretraining.register_for_auto_class("AutoModelForPreTraining")
MMFusionForImageTextClassification.register_for_auto_class("AutoModelForVisualQuestionAnswering")
MMFusionImageProcessor.register_for_auto_class("AutoImageProcessor")
MMFusionProcessor.register_for_auto_class("AutoProcessor")

# Pipelines for the tasks transformers lacks, each loading its model through an Auto class (transformers#33272), after
# checking that the saved model has the head the task needs (head_check.py). A saved model carries those that serve
# its head, for `trust_remote_code` loading (`custom_pipelines.py`); transformers' own
# `zero-shot-image-classification` pipeline serves pretraining models through the Auto class above.
for _task, (_pipeline_class, _auto_class) in PIPELINE_TASKS.items():
    PIPELINE_REGISTRY.register_pipeline(
        _task,
        pipeline_class=_pipeline_class,
        pt_model=pipeline_loader(_auto_class, _pipeline_class.heads),
        type="multimodal",
    )

__all__ = [
    "CachedZeroShotImageClassificationPipeline",
    "ImageTextClassificationPipeline",
    "ImageTextMatchingPipeline",
    "ImageTextRetrievalPipeline",
    "MMFusionConfig",
    "MMFusionForImageTextClassification",
    "MMFusionForPretraining",
    "MMFusionPretrainingLoss",
    "MMFusionImageProcessor",
    "MMFusionModel",
    "MMFusionOnnxModel",
    "MMFusionPreTrainedModel",
    "MMFusionProcessor",
    "MissingHeadError",
    "RetrievalIndex",
    "UnknownWordsWarning",
    "check_model_path",
    "train_tokenizer",
]
