"""
Sort-of-CLEVR: a relational VQA benchmark generated on the fly, offline and deterministically.

In the spirit of Santoro et al. 2017 ("A simple neural network module for relational reasoning", arXiv:1706.01427):
every image holds one object of each of `num_objects` distinct colours, each a square or a circle, at random
non-overlapping positions on a white background. Questions are natural language:

- non-relational: the shape of the <colour> object; is it on the left; is it at the top;
- relational: the shape of the object closest to / furthest from the <colour> object; how many objects have the
  shape of the <colour> object (itself included).

Each image also has a caption naming every object with its shape and its cell of a 3 x 3 grid ("a red circle at
the top left, ..."), unique across all splits, for retrieval and contrastive pretraining. Scenes where a closest or
furthest object is not clear (two candidates within `min_distance_gap` pixels) are drawn again, so every answer is
unambiguous. The scene itself is a column (`objects`), so answers can be checked against it.
"""

import io
import math
from collections.abc import Sequence

import numpy as np
from datasets import ClassLabel, Dataset, DatasetDict, Features, Image, List, Value
from datasets.exceptions import DatasetGenerationError


# The paper's six colours; a scene uses the first `num_objects` of them.
COLOURS = {
    "red": (230, 25, 25),
    "green": (30, 170, 40),
    "blue": (30, 60, 230),
    "orange": (255, 140, 0),
    "grey": (128, 128, 128),
    "yellow": (240, 220, 0),
}
SHAPES = ("square", "circle")
QUESTION_FAMILIES = {
    # family: (question type, template)
    "shape": ("non_relational", "What is the shape of the {colour} object?"),
    "horizontal": ("non_relational", "Is the {colour} object on the left?"),
    "vertical": ("non_relational", "Is the {colour} object at the top?"),
    "closest": ("relational", "What is the shape of the object closest to the {colour} object?"),
    "furthest": ("relational", "What is the shape of the object furthest from the {colour} object?"),
    "count": ("relational", "How many objects have the shape of the {colour} object?"),
}
ROWS = ("questions", "captions")
SPLITS = ("train", "test")
# Bumped whenever the generated data changes, so that a cached copy of an older generator is not reused.
GENERATOR_VERSION = 1


def answer_names(num_objects: int = 6) -> list[str]:
    """The answer vocabulary: the shapes, yes / no, and the counts 1..num_objects."""
    return [*SHAPES, "yes", "no", *(str(n) for n in range(1, num_objects + 1))]


def vocabulary_texts() -> list[str]:
    """Every question, and captions using every word, so a tokenizer trained on them covers all the generator says."""
    texts = [template.format(colour=colour) for _, template in QUESTION_FAMILIES.values() for colour in COLOURS]
    cells = [_grid_cell(x, y, 3) for y in range(3) for x in range(3)]
    texts += [f"a {colour} {shape} at {cell}." for colour in COLOURS for shape in SHAPES for cell in cells]
    return texts + ["an orange square."]


def load_sort_of_clevr(
    splits: Sequence[str] = SPLITS,
    *,
    rows: str = "questions",
    num_train_images: int = 10_000,
    num_test_images: int = 1_000,
    num_objects: int = 6,
    image_size: int = 64,
    object_size: int = 10,
    questions_per_family: int = 1,
    min_distance_gap: float = 2.0,
    seed: int = 0,
) -> DatasetDict:
    """
    Generate (or load from the `datasets` cache) Sort-of-CLEVR splits.

    Args:
        splits: any of `"train"`, `"test"`; the images of the two never share a caption.
        rows: `"questions"`: one row per question, with columns `id`, `image` (PNG), `image_id`, `question`,
            `answer` (`ClassLabel`, see [`answer_names`]), `question_type` (`"relational"` / `"non_relational"`),
            `question_family` (`shape`, `horizontal`, `vertical`, `closest`, `furthest`, `count`), `caption`,
            `objects`. `"captions"`: one row per image, with `id`, `image`, `image_id`, `caption`, `objects`.
        num_train_images, num_test_images: images per split.
        num_objects: objects (and colours) per image, 2 to 6.
        image_size, object_size: side of the image and of each object (a circle's diameter), in pixels.
        questions_per_family: questions of each of the six families per image (each about a colour drawn at random).
        min_distance_gap: scenes where the closest or furthest object from any object is not this many pixels clearer
            than the runner-up are drawn again.
        seed: the same arguments always give the same data.
    """
    unknown = [s for s in splits if s not in SPLITS]
    if unknown:
        raise ValueError(f"Sort-of-CLEVR has splits {list(SPLITS)}; got {unknown}.")
    if rows not in ROWS:
        raise ValueError(f"rows must be one of {ROWS}, got {rows!r}.")
    if not 2 <= num_objects <= len(COLOURS):
        raise ValueError(f"num_objects must be between 2 and {len(COLOURS)}, got {num_objects}.")
    if object_size < 2 or image_size < 4 * object_size:
        raise ValueError(
            f"object_size ({object_size}) must be at least 2 and image_size ({image_size}) at least 4x object_size, "
            "so that the objects fit without overlapping."
        )
    for name, value in (("num_train_images", num_train_images), ("num_test_images", num_test_images)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}.")
    if questions_per_family < 1:
        raise ValueError(f"questions_per_family must be >= 1, got {questions_per_family}.")
    options = {
        "num_train_images": num_train_images,
        "num_test_images": num_test_images,
        "num_objects": num_objects,
        "image_size": image_size,
        "object_size": object_size,
        "questions_per_family": questions_per_family,
        "min_distance_gap": min_distance_gap,
        "seed": seed,
        "version": GENERATOR_VERSION,
    }
    object_feature = {"colour": Value("string"), "shape": Value("string"), "x": Value("int32"), "y": Value("int32")}
    features = {
        "id": Value("string"),
        "image": Image(),
        "image_id": Value("int64"),
        "caption": Value("string"),
        "objects": List(object_feature),
    }
    if rows == "questions":
        features.update(
            question=Value("string"),
            answer=ClassLabel(names=answer_names(num_objects)),
            question_type=Value("string"),
            question_family=Value("string"),
        )
    # Written by a generator so that each split lands in the Arrow cache, keyed on these arguments: a second call
    # loads it, and the maps of `prepare_dataset` are cached in turn.
    try:
        return DatasetDict(
            {
                split: Dataset.from_generator(
                    _rows, features=Features(features), gen_kwargs={"split": split, "rows": rows, **options}
                )
                for split in splits
            }
        )
    except DatasetGenerationError as err:  # our own error about the options, rather than datasets' wrapper
        if isinstance(err.__cause__, ValueError):
            raise err.__cause__ from None
        raise


def generate_scenes(
    num_train_images: int,
    num_test_images: int,
    num_objects: int,
    image_size: int,
    object_size: int,
    min_distance_gap: float,
    seed: int,
) -> dict[str, list[list[dict]]]:
    """
    The scenes of both splits, each a list of objects `{"colour", "shape", "x", "y"}` (the centre, in pixels). Drawn
    in order, train then test, so that captions are unique across the splits: a scene whose caption was already
    drawn is drawn again.
    """
    rng = np.random.default_rng(seed)
    seen: set[str] = set()
    scenes = {}
    for split, count in (("train", num_train_images), ("test", num_test_images)):
        scenes[split] = []
        misses = 0
        while len(scenes[split]) < count:
            scene = _draw_scene(rng, num_objects, image_size, object_size)
            if not _unambiguous(scene, min_distance_gap):
                continue
            caption = describe_scene(scene, image_size)
            if caption in seen:
                misses += 1
                if misses > 1000 + 10 * len(seen):  # the distinct captions are running out: this would not end
                    raise ValueError(
                        f"Cannot draw {num_train_images + num_test_images} images with distinct captions from "
                        f"{num_objects} objects (only {len(seen)} found); use more objects or fewer images."
                    )
                continue
            seen.add(caption)
            scenes[split].append(scene)
    return scenes


def _draw_scene(rng: np.random.Generator, num_objects: int, image_size: int, object_size: int) -> list[dict]:
    """Objects of distinct colours at random positions, their boxes apart by at least a quarter of their size."""
    low, high = object_size // 2 + 1, image_size - object_size // 2 - 2
    min_centre_distance = object_size * 1.25
    objects: list[dict] = []
    for colour in list(COLOURS)[:num_objects]:
        while True:
            x, y = (int(v) for v in rng.integers(low, high + 1, size=2))
            if all(max(abs(x - o["x"]), abs(y - o["y"])) >= min_centre_distance for o in objects):
                break
        objects.append({"colour": colour, "shape": SHAPES[int(rng.integers(2))], "x": x, "y": y})
    return objects


def _unambiguous(scene: list[dict], gap: float) -> bool:
    """Whether every object's closest and furthest neighbours are clear by `gap` pixels."""
    for i, anchor in enumerate(scene):
        distances = sorted(
            math.dist((anchor["x"], anchor["y"]), (o["x"], o["y"])) for j, o in enumerate(scene) if j != i
        )
        if len(distances) > 1 and (distances[1] - distances[0] < gap or distances[-1] - distances[-2] < gap):
            return False
    return True


def _grid_cell(x: int, y: int, image_size: int) -> str:
    rows, columns = ("top", "middle", "bottom"), ("left", "centre", "right")
    row, column = rows[min(3 * y // image_size, 2)], columns[min(3 * x // image_size, 2)]
    if (row, column) == ("middle", "centre"):
        return "the centre"
    if row == "middle":
        return f"the middle {column}"
    return f"the {row} {column}"


def describe_scene(scene: list[dict], image_size: int) -> str:
    """The caption: every object, in the fixed colour order, with its shape and 3 x 3 grid cell."""
    parts = []
    for o in scene:
        article = "an" if o["colour"][0] in "aeiou" else "a"
        parts.append(f"{article} {o['colour']} {o['shape']} at {_grid_cell(o['x'], o['y'], image_size)}")
    return ", ".join(parts) + "."


def render_scene(scene: list[dict], image_size: int, object_size: int) -> "PIL.Image.Image":  # noqa: F821
    """The scene as an RGB image: squares and circles of side / diameter `object_size`, centred on their position."""
    from PIL import Image as PILImage
    from PIL import ImageDraw

    image = PILImage.new("RGB", (image_size, image_size), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    half = object_size // 2
    for o in scene:
        box = (o["x"] - half, o["y"] - half, o["x"] - half + object_size - 1, o["y"] - half + object_size - 1)
        if o["shape"] == "square":
            draw.rectangle(box, fill=COLOURS[o["colour"]])
        else:
            draw.ellipse(box, fill=COLOURS[o["colour"]])
    return image


def named_colour(question: str) -> str:
    """The colour a question names its object by."""
    for word in question.rstrip("?").split():
        if word in COLOURS:
            return word
    raise ValueError(f"The question {question!r} names no colour of {list(COLOURS)}.")


def named_object_boxes(questions: Sequence[str], scenes: Sequence[list[dict]], object_size: int = 10) -> list[tuple]:
    """Per question, the pixel box `(x0, y0, x1, y1)` (inclusive) of the object it names in its scene, as
    [`render_scene`] draws it."""
    half = object_size // 2
    boxes = []
    for question, scene in zip(questions, scenes):
        colour = named_colour(question)
        named = next(o for o in scene if o["colour"] == colour)
        x0, y0 = named["x"] - half, named["y"] - half
        boxes.append((x0, y0, x0 + object_size - 1, y0 + object_size - 1))
    return boxes


def answer_question(scene: list[dict], family: str, colour: str, image_size: int) -> str:
    """The answer to a question of `family` about the `colour` object of `scene`."""
    anchor = next(o for o in scene if o["colour"] == colour)
    others = [o for o in scene if o is not anchor]

    def distance(o):
        return math.dist((anchor["x"], anchor["y"]), (o["x"], o["y"]))

    if family == "shape":
        return anchor["shape"]
    if family == "horizontal":
        return "yes" if anchor["x"] < image_size / 2 else "no"
    if family == "vertical":
        return "yes" if anchor["y"] < image_size / 2 else "no"
    if family == "closest":
        return min(others, key=distance)["shape"]
    if family == "furthest":
        return max(others, key=distance)["shape"]
    if family == "count":
        return str(sum(o["shape"] == anchor["shape"] for o in scene))
    raise ValueError(f"Unknown question family {family!r}; expected one of {list(QUESTION_FAMILIES)}.")


def _rows(split: str, rows: str, questions_per_family: int, version: int, **options):
    """The rows of one split (see `load_sort_of_clevr`)."""
    image_size, object_size, seed = options["image_size"], options["object_size"], options["seed"]
    scenes = generate_scenes(**options)[split]
    # Questions are drawn from their own stream per split, independent of the scene draws.
    rng = np.random.default_rng([seed, SPLITS.index(split), 1])
    colours = list(COLOURS)[: options["num_objects"]]
    question = 0
    for image_id, scene in enumerate(scenes):
        buffer = io.BytesIO()
        render_scene(scene, image_size, object_size).save(buffer, format="PNG")
        image = {"bytes": buffer.getvalue(), "path": None}
        common = {"image": image, "image_id": image_id, "caption": describe_scene(scene, image_size), "objects": scene}
        if rows == "captions":
            yield {"id": f"{split}-{image_id}", **common}
            continue
        for family, (question_type, template) in QUESTION_FAMILIES.items():
            for _ in range(questions_per_family):
                colour = colours[int(rng.integers(len(colours)))]
                yield {
                    "id": f"{split}-{question}",
                    **common,
                    "question": template.format(colour=colour),
                    "answer": answer_question(scene, family, colour, image_size),
                    "question_type": question_type,
                    "question_family": family,
                }
                question += 1
