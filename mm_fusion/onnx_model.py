"""
An ONNX export (`python -m mm_fusion.export`) run by onnxruntime behind the PyTorch model's interface, so that the
pipelines serve it with the preprocessing the model was trained with:

```python
>>> from transformers import AutoProcessor, pipeline
>>> from mm_fusion import MMFusionOnnxModel

>>> model = MMFusionOnnxModel.from_pretrained("./outputs/easy_vqa_onnx")
>>> vqa = pipeline("image-text-classification", model=model, processor=AutoProcessor.from_pretrained(model.path))
>>> vqa(image="circle.png", question="What shape is this?")
```

It gives what the pipelines read: `logits` (classification), `itm_logits` (matching), `get_image_features` /
`get_text_features` (retrieval, zero-shot) and `logit_scale`. The attention maps (`return_map=True`) need the PyTorch
model.
"""

import json
import os
from pathlib import Path

import torch
from transformers import AutoConfig
from transformers.modeling_outputs import BaseModelOutputWithPooling
from transformers.utils import ModelOutput


class MMFusionOnnxModel:
    """
    The graphs of one exported head, each an onnxruntime session, called as the PyTorch head is: keyword tensors in,
    a `ModelOutput` of tensors out. CPU only by default; pass onnxruntime `providers` for others.
    """

    device = torch.device("cpu")
    dtype = torch.float32
    hf_device_map = None

    def __init__(self, path: Path, config, manifest: dict, sessions: dict):
        # Imported here, not when mm_fusion is: `python -m mm_fusion.export` would otherwise run a second copy of the
        # module the package had already imported (and runpy warns of it on stderr).
        from .export import CLASSIFICATION_GRAPHS, PRETRAINING_GRAPHS

        self.path, self.config, self.manifest, self.sessions = path, config, manifest, sessions
        self.graphs = {graph.name: graph for graph in (*CLASSIFICATION_GRAPHS, *PRETRAINING_GRAPHS)}
        scale = manifest.get("logit_scale")
        self.logit_scale = torch.tensor(scale) if scale is not None else None

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, providers: list[str] | None = None) -> "MMFusionOnnxModel":
        import onnxruntime

        from .export import MANIFEST_NAME

        path = Path(path)
        manifest_path = path / MANIFEST_NAME
        if not manifest_path.is_file():
            raise FileNotFoundError(
                f"{path} has no {MANIFEST_NAME}: it is not a directory `python -m mm_fusion.export` wrote."
            )
        manifest = json.loads(manifest_path.read_text())
        config = AutoConfig.from_pretrained(path)
        providers = providers or ["CPUExecutionProvider"]
        sessions = {
            name: onnxruntime.InferenceSession(str(path / entry["file"]), providers=providers)
            for name, entry in manifest["graphs"].items()
        }
        return cls(path, config, manifest, sessions)

    # -- what Pipeline asks of a model ------------------------------------------------------------------------------
    @property
    def name_or_path(self) -> str:
        return str(self.path)

    @property
    def base_model(self) -> "MMFusionOnnxModel":
        return self

    def can_generate(self) -> bool:
        return False

    def eval(self) -> "MMFusionOnnxModel":
        return self

    def to(self, device) -> "MMFusionOnnxModel":
        if torch.device(device).type != "cpu":
            raise ValueError(
                f"MMFusionOnnxModel runs on onnxruntime's providers, not on torch devices: got {device}. Pass "
                "`providers=[...]` to from_pretrained instead."
            )
        return self

    # -- the model's calls ----------------------------------------------------------------------------------------
    def _run(self, name: str, **inputs: torch.Tensor) -> torch.Tensor:
        if name not in self.sessions:
            head = self.manifest["head"]
            raise ValueError(f"This export ({head}) has no {name} graph; it has {', '.join(self.sessions)}.")
        graph = self.graphs[name]
        feed = {key: inputs[key].cpu().numpy() for key in graph.inputs}
        return torch.from_numpy(self.sessions[name].run(list(graph.outputs), feed)[0])

    @staticmethod
    def _text(input_ids, attention_mask, token_type_ids) -> dict[str, torch.Tensor]:
        if token_type_ids is not None and bool(token_type_ids.any()):
            raise ValueError("The exported graphs read one segment per text: token_type_ids must be all 0.")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        return {"input_ids": input_ids, "attention_mask": attention_mask}

    def __call__(
        self,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        image_index: torch.Tensor | None = None,
        return_loss: bool | None = None,
    ) -> ModelOutput:
        if return_loss:
            raise ValueError("MMFusionOnnxModel serves; it computes no loss.")
        text = self._text(input_ids, attention_mask, token_type_ids)
        if image_index is not None:  # distinct images and each text's row in them, as the pipelines give them
            pixel_values = pixel_values[image_index]
        if "model" in self.sessions:
            return ModelOutput(logits=self._run("model", pixel_values=pixel_values, **text))
        return ModelOutput(itm_logits=self._run("matching", pixel_values=pixel_values, **text))

    forward = __call__

    def image_maps(self, *args, **kwargs):
        raise ValueError(
            "Where the model looked (return_map=True) needs its attention or gradients, which the ONNX graphs do not "
            "give: load the PyTorch model the export was made from for maps."
        )

    def get_image_features(self, pixel_values: torch.Tensor, **unused) -> BaseModelOutputWithPooling:
        return BaseModelOutputWithPooling(pooler_output=self._run("image_encoder", pixel_values=pixel_values))

    def get_text_features(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        **unused,
    ) -> BaseModelOutputWithPooling:
        text = self._text(input_ids, attention_mask, token_type_ids)
        return BaseModelOutputWithPooling(pooler_output=self._run("text_encoder", **text))


__all__ = ["MMFusionOnnxModel"]
