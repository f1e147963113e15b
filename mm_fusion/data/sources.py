"""Image-text pair sources as `datasets` objects: the bundled easy-VQA, local files, or an in-memory dataset."""

import os
import re
from collections.abc import Sequence

from datasets import ClassLabel, Dataset, DatasetDict, Features, Value

from .tables import read_table


def load_easy_vqa(splits: Sequence[str] = ("train", "test")) -> DatasetDict:
    """
    The easy-VQA dataset shipped in the `easy-vqa` PyPI package (offline; 4,000 train / 1,000 test 64x64 images,
    38,575 / 9,673 questions, 13 answers) as a `DatasetDict` with one row per question.

    Columns: `id` (unique, e.g. `"train-17"`), `image` (absolute path of the PNG), `image_id` (questions about the same
    picture share it), `question`, `answer` (a `ClassLabel` over the 13 answers) and `question_type`: `shape` / `color`
    (what is the shape / its colour), `yes_no_shape` / `yes_no_color` (is there a shape / a colour named in it).
    """
    import easy_vqa

    unknown = [s for s in splits if s not in ("train", "test")]
    if unknown:
        raise ValueError(f"easy-VQA has splits ['train', 'test']; got {unknown}.")
    answer_names = easy_vqa.get_answers()
    features = Features(
        {
            "id": Value("string"),
            "image": Value("string"),
            "image_id": Value("int64"),
            "question": Value("string"),
            "answer": ClassLabel(names=answer_names),
            "question_type": Value("string"),
        }
    )
    # Built by a generator so the splits are written to the Arrow cache: later `map` calls are then cached by
    # fingerprint and reused across runs. The cache is keyed on the generator's arguments, so the package's location
    # is one: the rows hold absolute paths, and a cache written by an install elsewhere (another virtual environment)
    # would point at files that are gone.
    package = os.path.dirname(os.path.abspath(easy_vqa.__file__))
    return DatasetDict(
        {
            split: Dataset.from_generator(
                _easy_vqa_rows, features=features, gen_kwargs={"split": split, "package": package}
            )
            for split in splits
        }
    )


def _easy_vqa_rows(split: str, package: str):
    """Rows of one easy-VQA split, one per question; answers as strings, encoded by the `ClassLabel` feature."""
    import easy_vqa

    if split == "train":
        (questions, answers, image_ids), paths = easy_vqa.get_train_questions(), easy_vqa.get_train_image_paths()
    else:
        (questions, answers, image_ids), paths = easy_vqa.get_test_questions(), easy_vqa.get_test_image_paths()
    for i, (question, answer, image_id) in enumerate(zip(questions, answers, image_ids)):
        yield {
            "id": f"{split}-{i}",
            "image": paths[image_id],
            "image_id": image_id,
            "question": question,
            "answer": answer,
            "question_type": easy_vqa_question_type(question, answer),
        }


EASY_VQA_SHAPES = ("circle", "rectangle", "triangle")


def easy_vqa_question_type(question: str, answer: str) -> str:
    """What an easy-VQA question asks: `shape` or `color` (its answer names one), or, for a yes / no question,
    `yes_no_shape` when it names a shape and `yes_no_color` when it names a colour."""
    if answer not in ("yes", "no"):
        return "shape" if answer in EASY_VQA_SHAPES else "color"
    words = re.findall(r"[a-z]+", question.lower())
    return "yes_no_shape" if any(shape in words for shape in EASY_VQA_SHAPES) else "yes_no_color"


def load_pairs(source: str | os.PathLike | Dataset, split: str = "train", **load_kwargs) -> Dataset:
    """
    Image-text pairs from a table in any form [`read_table`] reads (json / jsonl / csv / tsv / parquet files, a
    `save_to_disk` directory, an imagefolder with `metadata.jsonl` / `metadata.csv`, a hub data set name for users with
    the hub), or a `datasets.Dataset` (e.g. with an `Image` column), as it is. A defect of the table is a
    [`DataError`] naming its file and line. Column names are chosen later, in `prepare_dataset`.
    """
    if isinstance(source, Dataset):
        return source
    return read_table(source, split=split, **load_kwargs)
