"""
Pipelines for MMFusion models: `pipeline(task, model=dir)` for the tasks transformers has no pipeline for.

- `image-text-classification`: VQA, or any image + text -> label task ([`ImageTextClassificationPipeline`]);
- `image-text-matching`: the probability that an image and a text match ([`ImageTextMatchingPipeline`]);
- `image-text-retrieval`: a gallery index of image or text embeddings, queried by the other modality, with an
  optional matching-head re-rank ([`ImageTextRetrievalPipeline`], [`RetrievalIndex`]);
- `cached-zero-shot-image-classification`: zero-shot image classification that encodes the label prompts once and
  reuses them ([`CachedZeroShotImageClassificationPipeline`]); transformers' own `zero-shot-image-classification`
  pipeline works with MMFusion pretraining models too.

Every pipeline reads images with the model's saved processor ([`MMFusionImageProcessor`]: the function that built
the training cache) and scores as the saved config says (`problem_type`), so serving sees what training saw. Texts
with words the tokenizer never saw are named in an [`UnknownWordsWarning`] (and in the results of the classification
and matching pipelines). This module is saved next to the weights, so `pipeline(task, model=dir,
trust_remote_code=True)` works where mm_fusion is not installed.
"""

import json
import math
import os
import warnings
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
import torch.nn.functional as F
from transformers import Pipeline
from transformers.utils import logging


try:  # tqdm ships with transformers; a missing one only loses the progress bar
    from tqdm.auto import tqdm
except ImportError:  # pragma: no cover
    tqdm = None


logger = logging.get_logger(__name__)

# How many texts an UnknownWordsWarning names; the results of every text carry their own.
WARNED_TEXTS = 5


class UnknownWordsWarning(UserWarning):
    """
    Texts given to a pipeline hold words its tokenizer never saw, which the model cannot read: its answer rests on the
    other words. A tokenizer trained from scratch (`train_tokenizer`, as `scripts/train.py` does without a pretrained
    text tower) knows only the words of its training texts. `warnings.simplefilter("ignore", UnknownWordsWarning)`
    silences it; [`_MMFusionPipeline.unknown_words`] gives the words.
    """


def _is_image_batch(value) -> bool:
    """A list / tuple of images (or a 4-D array / tensor) rather than one image."""
    if isinstance(value, (list, tuple)):
        return True
    return hasattr(value, "ndim") and value.ndim == 4


def _encoder(model, name: str):
    """The model's own `get_image_features` / `get_text_features`, or its base model's."""
    return getattr(model, name, None) or getattr(model.base_model, name)


def _features(output) -> torch.Tensor:
    """The embedding of a `get_*_features` call, whether it returns a tensor or a model output."""
    return output if isinstance(output, torch.Tensor) else output.pooler_output


class _MMFusionPipeline(Pipeline):
    """Shared parts: the processor, image loading with named errors, batching with a progress bar."""

    _load_processor = True
    _load_image_processor = False
    _load_tokenizer = False
    _load_feature_extractor = False
    # Which MMFusion heads a pipeline can serve (`config.architectures` of a saved model).
    heads: tuple[str, ...] = ()

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.tokenizer is None or self.image_processor is None:
            raise ValueError(
                f"The {self.task or type(self).__name__} pipeline needs the model's processor (tokenizer and image "
                "processor): save it next to the model (`processor.save_pretrained(dir)`; scripts/train.py does) or "
                "pass `processor=`."
            )
        architectures = getattr(self.model.config, "architectures", None) or [type(self.model).__name__]
        if self.heads and not set(architectures) & set(self.heads):  # what was saved, not what loaded it
            raise ValueError(
                f"The {self.task} pipeline needs a model trained with the head {' or '.join(self.heads)}, but this "
                f"model was saved as {', '.join(architectures)}."
            )

    # -- inputs ---------------------------------------------------------------------------------------------------
    @property
    def max_length(self) -> int | None:
        return getattr(self.processor, "max_length", None)

    def _tokenize(self, texts: list[str]) -> dict[str, torch.Tensor]:
        for i, text in enumerate(texts):
            if not isinstance(text, str) or not text.strip():
                raise ValueError(f"Input {i}: a text must be a non-empty string, got {text!r}.")
        max_length = self.max_length
        encoded = self.tokenizer(
            texts, padding=True, truncation=max_length is not None, max_length=max_length, return_tensors="pt"
        )
        return {k: v for k, v in encoded.items() if k in ("input_ids", "attention_mask", "token_type_ids")}

    @cached_property
    def _whole_word_vocabulary(self) -> bool:
        """Whether the tokenizer's vocabulary is whole words plus single characters (`train_tokenizer` on texts whose
        words all fit in it): every word of its training texts is then one token, and a word split into pieces is one
        it never saw."""
        pieces = [token for token in self.tokenizer.get_vocab() if token.startswith("##")]
        return bool(pieces) and all(len(token) == 3 for token in pieces)

    def unknown_words(self, texts: list[str]) -> list[list[str]]:
        """
        Per text, the words of it the model cannot read: those the tokenizer maps to its unknown token (`[UNK]`), and
        with a vocabulary of whole words (a tokenizer trained from scratch), those that are not one of its tokens:
        they are split into pieces whose embeddings training never used.
        """
        tokenizer, unknown_id = self.tokenizer, self.tokenizer.unk_token_id
        if not getattr(tokenizer, "is_fast", False):  # no word alignment: each whitespace-separated word on its own
            return [
                [word for word in text.split() if unknown_id in tokenizer(word, add_special_tokens=False)["input_ids"]]
                for text in texts
            ]
        encoded = tokenizer(list(texts), add_special_tokens=False, return_offsets_mapping=True)
        found = []
        for i, text in enumerate(texts):
            ids, offsets = encoded["input_ids"][i], encoded["offset_mapping"][i]
            words: dict[int, list[int]] = {}
            for position, word in enumerate(encoded.word_ids(i)):
                if word is not None:
                    words.setdefault(word, []).append(position)
            unknown = []
            for positions in words.values():
                if unknown_id in (ids[p] for p in positions) or (self._whole_word_vocabulary and len(positions) > 1):
                    unknown.append(text[offsets[positions[0]][0] : offsets[positions[-1]][1]])
            found.append(list(dict.fromkeys(unknown)))
        return found

    def _warn_unknown_words(self, unknown: list[list[str]], kind: str, listed: bool = False) -> None:
        """One [`UnknownWordsWarning`] for a call, naming the first texts with unknown words; `listed`: their results
        carry them as `unknown_words`."""
        flagged = [(i, words) for i, words in enumerate(unknown) if words]
        if not flagged:
            return
        named = "; ".join(f"input {i}: {', '.join(map(repr, words))}" for i, words in flagged[:WARNED_TEXTS])
        more = f"; and {len(flagged) - WARNED_TEXTS} more" if len(flagged) > WARNED_TEXTS else ""
        results = (
            "their results rest on the other words and list these as `unknown_words`"
            if listed
            else ("their results rest on the other words")
        )
        warnings.warn(
            f"Words this model's tokenizer never saw, which the model cannot read, in {len(flagged)} of "
            f"{len(unknown)} {kind} ({named}{more}); {results}. A tokenizer trained from scratch knows only the "
            "words of its training texts.",
            UnknownWordsWarning,
            stacklevel=2,
        )

    def _load_images(self, images: list, positions: list[int]) -> torch.Tensor:
        """Distinct images as the model's `pixel_values`; a bad one is a `ValueError` naming its input position."""
        processor = self.image_processor
        if not hasattr(processor, "load_batch"):  # another image processor: its own float output
            return processor(images=images, return_tensors="pt")["pixel_values"]
        names = [f"Input {position}" for position in positions]
        return torch.from_numpy(processor.load_batch(images, names=names))

    def _embed_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        with self.device_placement(), torch.no_grad():
            out = _encoder(self.model, "get_image_features")(pixel_values=pixel_values.to(self.device))
        return F.normalize(_features(out).float(), dim=-1).cpu()

    def _embed_texts(self, texts: list[str]) -> torch.Tensor:
        inputs = {k: v.to(self.device) for k, v in self._tokenize(texts).items()}
        with self.device_placement(), torch.no_grad():
            out = _encoder(self.model, "get_text_features")(**inputs)
        return F.normalize(_features(out).float(), dim=-1).cpu()

    def _distinct_images(self, images: list, positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each distinct image of a batch read once: their `pixel_values` and each input's row in them."""
        rows: dict[Any, int] = {}
        firsts: list[tuple[Any, int]] = []  # (image, input position) of each distinct image, for error messages
        index = []
        for image, position in zip(images, positions):
            key = self._image_key(image)
            if key not in rows:
                rows[key] = len(firsts)
                firsts.append((image, position))
            index.append(rows[key])
        pixel_values = self._load_images([image for image, _ in firsts], [position for _, position in firsts])
        return pixel_values, torch.tensor(index, dtype=torch.long)

    @staticmethod
    def _image_key(image) -> Any:
        """Inputs that are the same image: the same path, or the same object."""
        if isinstance(image, (str, os.PathLike)):
            return ("path", os.fspath(image))
        return ("object", id(image))

    def _batches(self, n: int, batch_size: int | None, desc: str):
        batch_size = batch_size or self._batch_size or 32
        starts = range(0, n, batch_size)
        if tqdm is not None and len(starts) > 1:
            starts = tqdm(starts, desc=desc, unit="batch", disable=logging.is_progress_bar_enabled() is False)
        for start in starts:
            yield start, min(start + batch_size, n)

    # The Pipeline interface: these pipelines batch (and share images) themselves, so `__call__` drives
    # `preprocess` -> `forward` (device placement, no-grad) -> `postprocess` over whole batches.
    def _sanitize_parameters(self, **kwargs):
        if kwargs:  # call options (top_k, ...) go to the call; nothing else may pass unnoticed
            raise TypeError(
                f"The {self.task or type(self).__name__} pipeline got unexpected arguments {sorted(kwargs)}."
            )
        return {}, {}, {}

    def save_pretrained(self, save_directory: str | os.PathLike, **kwargs) -> None:
        """The model (with its code and `custom_pipelines`) and the whole processor, which `Pipeline.save_pretrained`
        would split into its parts, losing the processor's own settings (`max_length`)."""
        self.model.save_pretrained(save_directory, **kwargs)
        if self.processor is not None:
            self.processor.save_pretrained(save_directory, **kwargs)
        else:
            self.tokenizer.save_pretrained(save_directory, **kwargs)
            self.image_processor.save_pretrained(save_directory, **kwargs)

    def preprocess(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} batches in __call__; see its docstring.")

    def postprocess(self, model_outputs, **kwargs):
        return model_outputs

    def _forward(self, model_inputs):
        return self.model(**model_inputs)


@dataclass
class _Pairs:
    images: list
    texts: list[str]
    single: bool


def _pairs(image, text, inputs, image_key: str, text_key: str) -> _Pairs:
    """Normalise the accepted call forms to parallel lists of images and texts."""
    if inputs is not None:
        if image is not None or text is not None:
            raise ValueError(f"Pass either `{image_key}=` and `{text_key}=`, or the inputs positionally, not both.")
        if isinstance(inputs, dict):
            inputs, single = [inputs], True
        else:
            single = False
        images, texts = [], []
        for i, item in enumerate(inputs):
            if not isinstance(item, dict) or image_key not in item or text_key not in item:
                raise ValueError(
                    f"Input {i} must be a dict with {image_key!r} and {text_key!r} keys, got "
                    f"{item if not isinstance(item, dict) else sorted(item)!r:.120}."
                )
            images.append(item[image_key])
            texts.append(item[text_key])
        return _Pairs(images, texts, single)
    if image is None or text is None:
        raise ValueError(
            f"Pass `{image_key}=` and `{text_key}=` (or a list of {{'{image_key}', '{text_key}'}} dicts)."
        )
    many_images, many_texts = _is_image_batch(image), isinstance(text, (list, tuple))
    if many_images and many_texts:
        if len(image) != len(text):
            raise ValueError(f"Got {len(image)} images and {len(text)} texts; they are paired one to one.")
        return _Pairs(list(image), list(text), False)
    if many_texts:  # several texts about one image: the image is read and encoded once
        return _Pairs([image] * len(text), list(text), False)
    if many_images:
        return _Pairs(list(image), [text] * len(image), False)
    return _Pairs([image], [text], True)


class ImageTextClassificationPipeline(_MMFusionPipeline):
    r"""
    Image + text -> label, e.g. visual question answering as classification over the answers seen in training.

    Loaded with `pipeline("image-text-classification", model=dir)` for a model saved by `scripts/train.py --task vqa`
    or `--task classify` (or any `MMFusionForImageTextClassification` saved with its processor).

    Call forms: `pipe(image=..., question="...")`, `pipe(image=..., question=[...])` (several questions about one
    image: it is read and encoded once), `pipe(image=[...], question=[...])` (pairs), `pipe([{"image": ...,
    "question": ...}, ...])`, or a `datasets.Dataset` with `image` / `question` columns. Images are paths, PIL images,
    uint8 numpy arrays or tensors, or bytes. Each input gives `[{"answer": str, "score": float}, ...]`, best first;
    a single input gives that list, several give a list of them.

    Keyword arguments: `top_k` (answers per input, default 1), `batch_size` (default 32), `return_map` (default
    `False`): each answer also gets `"maps"`, where the model looked in the image for that answer, as `{name:
    (height, width) float numpy array}` on the image's pixels, summing to 1: the model's default map
    (`MMFusionForImageTextClassification.image_maps`; its name says the method: input x gradient weighted by the
    question's cross-attention; for a late-fusion model input x gradient alone). The map's pass gives the answers too.
    Scores are softmax probabilities for a single-label model and independent sigmoids for a multi-label one, as
    the model's `config.problem_type` says. The answers come from the answers seen in training (`config.id2label`).
    A question with words the tokenizer never saw ([`~_MMFusionPipeline.unknown_words`]) is answered from its other
    words, with an [`UnknownWordsWarning`], and each of its answers lists them: `{"answer", "score",
    "unknown_words": [...]}`.
    """

    heads = ("MMFusionForImageTextClassification",)

    def __call__(
        self,
        inputs=None,
        image=None,
        question=None,
        *,
        top_k: int = 1,
        batch_size: int | None = None,
        return_map: bool = False,
    ):
        if _is_dataset(inputs):
            inputs = _dataset_rows(inputs, ("image", "question"))
        pairs = _pairs(image, question, inputs, "image", "question")
        if not isinstance(top_k, int) or top_k < 1:
            raise ValueError(f"top_k must be a positive integer, got {top_k!r}.")
        if not isinstance(return_map, bool):
            raise ValueError(f"return_map must be True or False, got {return_map!r}.")
        results = self.run(pairs.images, pairs.texts, top_k=top_k, batch_size=batch_size, return_map=return_map)
        return results[0] if pairs.single else results

    def run(
        self, images: list, texts: list[str], top_k: int = 1, batch_size: int | None = None, return_map: bool = False
    ) -> list:
        """Answers for parallel lists of images and texts, batched with pairs of the same image together."""
        keys = [self._image_key(image) for image in images]
        first = {}
        for i, key in enumerate(keys):
            first.setdefault(key, i)
        order = sorted(range(len(images)), key=lambda i: first[keys[i]])  # same image -> same batch, stable
        results: list = [None] * len(images)
        for start, end in self._batches(len(order), batch_size, "image-text-classification"):
            chunk = order[start:end]
            model_inputs = self.preprocess([images[i] for i in chunk], [texts[i] for i in chunk], chunk)
            if return_map:
                answers = self._answers_with_maps(model_inputs, top_k)
            else:
                answers = self.postprocess(self.forward(model_inputs), top_k=top_k)
            for i, result in zip(chunk, answers):
                results[i] = result
        unknown = self.unknown_words(texts)
        self._warn_unknown_words(unknown, "questions", listed=True)
        for answers, words in zip(results, unknown):
            for answer in answers if words else ():
                answer["unknown_words"] = words
        return results

    def preprocess(self, images: list, texts: list[str], positions: list[int]) -> dict[str, torch.Tensor]:
        pixel_values, image_index = self._distinct_images(images, positions)
        return {"pixel_values": pixel_values, "image_index": image_index, **self._tokenize(texts)}

    def _answers_with_maps(self, model_inputs: dict[str, torch.Tensor], top_k: int) -> list[list[dict[str, Any]]]:
        """The answers, each with its `"maps"`: the model's default map ([`~image_maps.default_method`]). Its pass
        gives the answers' logits too, so no separate forward runs. A map computed from an answer's gradient explains
        that answer: one pass per answer rank; an attention map is the same for every answer of a pair."""
        if not hasattr(self.model, "image_maps"):
            raise ValueError(
                "return_map=True needs the model's `image_maps`, which this model's saved code predates: "
                "load it with the installed mm_fusion, or save it again with it."
            )
        inputs = {k: v.to(self.device) for k, v in model_inputs.items()}
        with self.device_placement():
            result = self.model.image_maps(**inputs)
            answers = self.postprocess({"logits": result.logits}, top_k=top_k)
            per_answer = result.method not in ("attention", "tower_attention")
            label2id = {label: int(i) for i, label in self.model.config.id2label.items()}
            for rank in range(len(answers[0]) if per_answer else 1):
                if rank:
                    targets = torch.tensor([label2id[row[rank]["answer"]] for row in answers], device=self.device)
                    result = self.model.image_maps(**inputs, targets=targets)
                maps = result.maps.float().cpu().numpy()
                for row, pair_maps in zip(answers, maps):
                    layer_maps = dict(zip(result.layers, pair_maps))
                    for answer in row[rank : rank + 1] if per_answer else row:
                        answer["maps"] = layer_maps
        return answers

    def postprocess(self, model_outputs, top_k: int = 1) -> list[list[dict[str, Any]]]:
        logits = model_outputs["logits"].float()
        if getattr(self.model.config, "problem_type", None) == "multi_label_classification":
            scores = logits.sigmoid()
        else:
            scores = logits.softmax(-1)
        top = scores.topk(min(top_k, scores.shape[-1]), dim=-1)
        id2label = self.model.config.id2label
        return [
            [{"answer": id2label[int(i)], "score": float(s)} for s, i in zip(row_scores, row_ids)]
            for row_scores, row_ids in zip(top.values, top.indices)
        ]


class ImageTextMatchingPipeline(_MMFusionPipeline):
    r"""
    The probability that an image and a text match, from the image-text matching head of a pretraining model
    (`scripts/train.py --task pretrain`): `pipe(image=..., text="...")` -> `{"score": float}`; several texts for one
    image, pairs of lists, or a list of `{"image", "text"}` dicts give a list. The score is the matching head's
    softmax probability of "matches". A text with words the tokenizer never saw gets an [`UnknownWordsWarning`] and
    `"unknown_words": [...]` in its result.
    """

    heads = ("MMFusionForPretraining",)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if getattr(self.model.config, "itm_loss_weight", 1.0) == 0:
            raise ValueError(
                "This model was trained with itm_loss_weight=0, so its matching head is untrained; use the "
                "image-text-retrieval pipeline (embedding similarity) instead."
            )

    def __call__(self, inputs=None, image=None, text=None, *, batch_size: int | None = None):
        if _is_dataset(inputs):
            inputs = _dataset_rows(inputs, ("image", "text"))
        pairs = _pairs(image, text, inputs, "image", "text")
        scores = []
        for start, end in self._batches(len(pairs.texts), batch_size, "image-text-matching"):
            positions = list(range(start, end))
            model_inputs = self.preprocess(pairs.images[start:end], pairs.texts[start:end], positions)
            scores += self.postprocess(self.forward(model_inputs))
        unknown = self.unknown_words(pairs.texts)
        self._warn_unknown_words(unknown, "texts", listed=True)
        for score, words in zip(scores, unknown):
            if words:
                score["unknown_words"] = words
        return scores[0] if pairs.single else scores

    def preprocess(self, images: list, texts: list[str], positions: list[int]) -> dict[str, torch.Tensor]:
        pixel_values, image_index = self._distinct_images(images, positions)
        # The pretraining forward pairs image i with text i.
        return {"pixel_values": pixel_values[image_index], "return_loss": False, **self._tokenize(texts)}

    def postprocess(self, model_outputs) -> list[dict[str, float]]:
        probabilities = model_outputs["itm_logits"].float().softmax(-1)[:, 1]
        return [{"score": float(p)} for p in probabilities]


@dataclass
class RetrievalIndex:
    r"""
    A gallery for [`ImageTextRetrievalPipeline`]: L2-normalised embeddings of images or texts, their ids, and what
    the matching head needs to re-rank (the texts, or the images' uint8 pixels). `save(dir)` writes
    `index.safetensors` + `index.json` (no pickle); `RetrievalIndex.load(dir)` reads them back.
    """

    modality: str  # "image" or "text": what the gallery holds
    embeddings: torch.Tensor  # (N, D) float32, L2-normalised
    ids: list[str]
    texts: list[str] | None = None
    pixel_values: torch.Tensor | None = None  # (N, 3, S, S) uint8, for re-ranking an image gallery
    model: str | None = None  # the model it was built with (its name or path), checked when queried
    extra: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.ids)

    def save(self, directory: str | os.PathLike) -> None:
        from safetensors.torch import save_file

        os.makedirs(directory, exist_ok=True)
        tensors = {"embeddings": self.embeddings.contiguous()}
        if self.pixel_values is not None:
            tensors["pixel_values"] = self.pixel_values.contiguous()
        save_file(tensors, os.path.join(directory, "index.safetensors"))
        meta = {"modality": self.modality, "ids": self.ids, "texts": self.texts, "model": self.model, **self.extra}
        with open(os.path.join(directory, "index.json"), "w") as f:
            json.dump(meta, f)

    @classmethod
    def load(cls, directory: str | os.PathLike) -> "RetrievalIndex":
        from safetensors.torch import load_file

        paths = [os.path.join(directory, name) for name in ("index.safetensors", "index.json")]
        missing = [p for p in paths if not os.path.isfile(p)]
        if missing:
            raise FileNotFoundError(f"{directory} is not a saved RetrievalIndex: missing {', '.join(missing)}.")
        tensors = load_file(paths[0])
        with open(paths[1]) as f:
            meta = json.load(f)
        modality, ids, texts, model = (meta.pop(k) for k in ("modality", "ids", "texts", "model"))
        return cls(modality, tensors["embeddings"], ids, texts, tensors.get("pixel_values"), model, meta)


class ImageTextRetrievalPipeline(_MMFusionPipeline):
    r"""
    Image-text retrieval with a pretraining model (`scripts/train.py --task pretrain`).

    ```python
    >>> retriever = pipeline("image-text-retrieval", model="out")
    >>> gallery = retriever.build_index(images=["a.png", "b.png"], ids=["a", "b"])  # or texts=[...]
    >>> gallery.save("gallery")  # RetrievalIndex.load("gallery") reads it back
    >>> retriever("a red circle", index=gallery, top_k=5)  # a text query for an image gallery
    [{'id': 'a', 'score': 0.83, 'rank': 0}, ...]
    ```

    The query is of the other modality than the gallery (a text, or an image for a text gallery); a list of queries
    gives a list of results. `score` is the cosine similarity of the embeddings the contrastive loss trained.
    `rerank=K` re-scores the top K candidates with the matching head (each gets `itm_score`, the matching
    probability, and the K are re-ordered by it).
    """

    heads = ("MMFusionForPretraining",)

    @torch.no_grad()
    def build_index(
        self,
        images: list | None = None,
        texts: list[str] | None = None,
        ids: list | None = None,
        batch_size: int | None = None,
        keep_inputs: bool = True,
    ) -> RetrievalIndex:
        """Embed a gallery of images or texts once, in batches (with a progress bar); `keep_inputs` keeps what a
        matching-head re-rank needs (the texts, or the images' uint8 pixels)."""
        if (images is None) == (texts is None):
            raise ValueError("build_index needs `images=` or `texts=` (one of them).")
        items = list(images if images is not None else texts)
        if not items:
            raise ValueError("build_index got an empty gallery.")
        ids = [str(i) for i in (ids if ids is not None else range(len(items)))]
        if len(ids) != len(items) or len(set(ids)) != len(ids):
            raise ValueError(f"`ids` must give one distinct id per item ({len(items)}); got {len(ids)} ids.")
        embeddings, pixels = [], []
        desc = f"indexing {len(items)} {'images' if images is not None else 'texts'}"
        for start, end in self._batches(len(items), batch_size, desc):
            if images is not None:
                batch = self._load_images(items[start:end], list(range(start, end)))
                embeddings.append(self._embed_images(batch))
                if keep_inputs:
                    pixels.append(batch)
            else:
                embeddings.append(self._embed_texts(items[start:end]))
        if texts is not None:
            self._warn_unknown_words(self.unknown_words(items), "gallery texts")
        return RetrievalIndex(
            modality="image" if images is not None else "text",
            embeddings=torch.cat(embeddings),
            ids=ids,
            texts=items if texts is not None and keep_inputs else None,
            pixel_values=torch.cat(pixels) if pixels else None,
            model=getattr(self.model.config, "_name_or_path", None),
        )

    def __call__(
        self,
        inputs=None,
        *,
        index: RetrievalIndex,
        top_k: int = 5,
        rerank: int | None = None,
        batch_size: int | None = None,
    ):
        if not isinstance(index, RetrievalIndex):
            raise TypeError(
                f"`index` must be a RetrievalIndex (from build_index or RetrievalIndex.load), got {index!r}."
            )
        if inputs is None:
            raise ValueError("Pass a query (a text for an image gallery, an image for a text gallery), or a list.")
        single = not (isinstance(inputs, (list, tuple)) or (hasattr(inputs, "ndim") and inputs.ndim == 4))
        queries = [inputs] if single else list(inputs)
        if index.modality == "image":
            query_embeds = torch.cat(
                [self._embed_texts(queries[s:e]) for s, e in self._batches(len(queries), batch_size, "queries")]
            )
            self._warn_unknown_words(self.unknown_words(queries), "queries")
        else:
            query_embeds = torch.cat(
                [
                    self._embed_images(self._load_images(queries[s:e], list(range(s, e))))
                    for s, e in self._batches(len(queries), batch_size, "queries")
                ]
            )
        similarity = query_embeds @ index.embeddings.t()  # (queries, gallery)
        k = min(max(top_k, rerank or 0), len(index))
        top = similarity.topk(k, dim=-1)
        results = []
        for q, (scores, rows) in enumerate(zip(top.values.tolist(), top.indices.tolist())):
            hits = [{"id": index.ids[r], "score": s, "row": r} for s, r in zip(scores, rows)]
            if rerank:
                hits = self._rerank(queries[q], hits[:rerank], index) + hits[rerank:]
            for rank, hit in enumerate(hits):
                hit["rank"] = rank
            results.append(hits[:top_k])
        return results[0] if single else results

    def _rerank(self, query, hits: list[dict], index: RetrievalIndex) -> list[dict]:
        """Re-score candidates with the matching head, which reads the fused pair."""
        rows = [hit["row"] for hit in hits]
        if index.modality == "image":
            if index.pixel_values is None:
                raise ValueError("This image index was built with keep_inputs=False, so it cannot be re-ranked.")
            pixel_values, texts = index.pixel_values[rows], [query] * len(rows)
        else:
            if index.texts is None:
                raise ValueError("This text index was built with keep_inputs=False, so it cannot be re-ranked.")
            pixel_values = self._load_images([query], [0]).expand(len(rows), -1, -1, -1)
            texts = [index.texts[r] for r in rows]
        outputs = self.forward({"pixel_values": pixel_values, "return_loss": False, **self._tokenize(texts)})
        probabilities = outputs["itm_logits"].float().softmax(-1)[:, 1].tolist()
        for hit, p in zip(hits, probabilities):
            hit["itm_score"] = p
        return sorted(hits, key=lambda hit: -hit["itm_score"])


class CachedZeroShotImageClassificationPipeline(_MMFusionPipeline):
    r"""
    Zero-shot image classification that embeds the label prompts once and reuses them: same call and output as
    transformers' `zero-shot-image-classification` pipeline (`pipe(images, candidate_labels=[...],
    hypothesis_template="This is a photo of {}.")` -> `[{"score", "label"}, ...]`, best first), but images are
    batched and the prompts' embeddings are cached per (labels, template), so the text tower runs once, not once
    per image.
    """

    heads = ("MMFusionForPretraining",)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._prompt_cache: dict[tuple, torch.Tensor] = {}

    def __call__(
        self,
        images,
        candidate_labels: list[str] | None = None,
        hypothesis_template: str = "This is a photo of {}.",
        batch_size: int | None = None,
    ):
        if not candidate_labels:
            raise ValueError("Pass `candidate_labels`, the labels to choose from.")
        single = not _is_image_batch(images)
        images = [images] if single else list(images)
        text_embeds = self.label_embeddings(list(candidate_labels), hypothesis_template)
        # The model's own logit scale (clamped as in training), so scores match transformers' stock pipeline.
        scale = self.model.logit_scale.detach().float().cpu().clamp(max=math.log(self.model.config.max_logit_scale))
        results = []
        for start, end in self._batches(len(images), batch_size, "zero-shot"):
            pixel_values = self._load_images(images[start:end], list(range(start, end)))
            image_embeds = self._embed_images(pixel_values)
            probabilities = (scale.exp() * image_embeds @ text_embeds.t()).softmax(-1)
            for row in probabilities.tolist():
                ranked = sorted(zip(row, candidate_labels), key=lambda pair: -pair[0])
                results.append([{"score": score, "label": label} for score, label in ranked])
        return results[0] if single else results

    def label_embeddings(self, labels: list[str], template: str) -> torch.Tensor:
        """The prompts' L2-normalised embeddings, computed once per (labels, template)."""
        key = (tuple(labels), template)
        if key not in self._prompt_cache:
            prompts = [template.format(label) for label in labels]
            self._prompt_cache[key] = self._embed_texts(prompts)
            self._warn_unknown_words(self.unknown_words(prompts), "label prompts")
        return self._prompt_cache[key]


def _is_dataset(value) -> bool:
    return type(value).__name__ == "Dataset" and hasattr(value, "column_names")


def _dataset_rows(dataset, columns: tuple[str, ...]) -> list[dict]:
    missing = [c for c in columns if c not in dataset.column_names]
    if missing:
        raise ValueError(
            f"The dataset needs the columns {list(columns)}; it lacks {missing} (it has {dataset.column_names}). "
            "Rename them with `dataset.rename_columns`."
        )
    data = dataset.select_columns(list(columns))
    return [dict(row) for row in data]


# Task name -> (pipeline class, the transformers Auto class that loads its model): registered by `mm_fusion`.
PIPELINE_TASKS = {
    "image-text-classification": (ImageTextClassificationPipeline, "AutoModelForVisualQuestionAnswering"),
    "image-text-matching": (ImageTextMatchingPipeline, "AutoModelForPreTraining"),
    "image-text-retrieval": (ImageTextRetrievalPipeline, "AutoModelForPreTraining"),
    "cached-zero-shot-image-classification": (
        CachedZeroShotImageClassificationPipeline,
        "AutoModelForZeroShotImageClassification",
    ),
}


__all__ = [
    "CachedZeroShotImageClassificationPipeline",
    "ImageTextClassificationPipeline",
    "ImageTextMatchingPipeline",
    "ImageTextRetrievalPipeline",
    "PIPELINE_TASKS",
    "RetrievalIndex",
    "UnknownWordsWarning",
]
