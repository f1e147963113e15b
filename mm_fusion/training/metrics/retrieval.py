"""Image-text retrieval Recall@K in both directions, as an `evaluate` module shipped with mm_fusion."""

import datasets
import evaluate
import numpy as np


_DESCRIPTION = """
Recall@K for text-to-image and image-to-text retrieval from paired embeddings. Pairs that share an image (same
`image_ids` value) count that image once: a text is answered correctly when its own image is among the K images most
similar to it; an image when any of its texts is among the K texts most similar to it.
"""

_KWARGS_DESCRIPTION = """
Args:
    image_embeds (`list[list[float]]`): one image embedding per pair (L2-normalised, or cosine is not used).
    text_embeds (`list[list[float]]`): one text embedding per pair.
    image_ids (`list[int]`): the identity of each pair's image.
    k_values (`list[int]`, defaults to [1, 5, 10]): the K of Recall@K.
Returns:
    text_to_image_R@K, image_to_text_R@K (`float`): in [0, 1], for each K; `mean_recall`: their mean.
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class RetrievalRecall(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {
                    "image_embeds": datasets.Sequence(datasets.Value("float32")),
                    "text_embeds": datasets.Sequence(datasets.Value("float32")),
                    "image_ids": datasets.Value("int64"),
                }
            ),
        )

    def _compute(self, image_embeds, text_embeds, image_ids, k_values=(1, 5, 10)):
        image_embeds, text_embeds = np.asarray(image_embeds, np.float32), np.asarray(text_embeds, np.float32)
        image_ids = np.asarray(image_ids)
        unique_ids, first = np.unique(image_ids, return_index=True)
        images = image_embeds[first]  # one embedding per distinct image
        pair_image = np.searchsorted(unique_ids, image_ids)  # each text's image, as a row of `images`
        similarity = text_embeds @ images.T  # (texts, images)
        # Rank of the true image for each text: how many images score strictly higher.
        true_score = similarity[np.arange(len(text_embeds)), pair_image]
        text_rank = (similarity > true_score[:, None]).sum(axis=1)
        # For each image, the best rank of any of its texts among all texts.
        image_rank = np.empty(len(images), dtype=np.int64)
        for j in range(len(images)):
            scores = similarity[:, j]
            best_own = scores[pair_image == j].max()
            image_rank[j] = (scores > best_own).sum()
        result = {}
        for k in k_values:
            result[f"text_to_image_R@{k}"] = float((text_rank < k).mean())
            result[f"image_to_text_R@{k}"] = float((image_rank < k).mean())
        result["mean_recall"] = float(np.mean(list(result.values())))
        return result
