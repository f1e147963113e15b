"""scripts/benchmarks/benchmark_pointing.py: the named object's box, and pointing accuracy counted per layer and
family."""

import json

import benchmark_pointing as bench  # scripts/benchmarks is on sys.path (conftest.py)
import numpy as np
import torch

from mm_fusion.data.sort_of_clevr import COLOURS
from mm_fusion.image_maps import ImageMaps


OPTIONS = "num_train_images=4,num_test_images=6,seed=3"


def test_boxes_cover_the_object_the_question_names():
    test, boxes = bench.held_out_questions(OPTIONS, images=5)
    assert sorted(set(test["image_id"])) == list(range(5)) and len(test) == len(boxes) == 5 * 6
    for row, (x0, y0, x1, y1) in zip(test, boxes.tolist()):
        colour = next(c for c in COLOURS if f" {c} " in row["question"])
        pixels = np.asarray(row["image"].convert("RGB"))
        # The box's centre holds the named colour (a circle's corners are background); the box is 10 x 10 pixels.
        assert tuple(pixels[(y0 + y1) // 2, (x0 + x1) // 2]) == COLOURS[colour]
        assert (x1 - x0, y1 - y0) == (9, 9)


class OracleModel:
    """Answers right, and its first layer's map peaks on the named object; the second peaks on the opposite corner."""

    def __init__(self, boxes: torch.Tensor, answers: list[int]):
        self.boxes, self.answers, self.position = boxes, answers, 0
        self.config = type("Config", (), {"id2label": dict(enumerate(bench_answer_names()))})()

    def image_maps(self, pixel_values, input_ids, attention_mask=None, method=None):
        n = pixel_values.shape[0]
        maps = torch.zeros(n, 2, 8, 8)
        for k in range(n):
            x0, y0, x1, y1 = self.boxes[self.position + k].tolist()
            maps[k, 0, ((y0 + y1) // 2) // 8, ((x0 + x1) // 2) // 8] = 1.0
            maps[k, 1, 0 if y0 > 32 else 7, 0 if x0 > 32 else 7] = 1.0
        logits = torch.nn.functional.one_hot(torch.tensor(self.answers[self.position : self.position + n]), 10).float()
        self.position += n
        return ImageMaps(maps, ["fusion layer 1", "fusion layer 2"], "attention", logits, logits.argmax(-1),
                         torch.zeros(n, 2))  # fmt: skip


def bench_answer_names():
    from mm_fusion.data.sort_of_clevr import answer_names

    return answer_names()


def fake_processor(images, text):
    # What the real processor accepts (transformers' `validate_inputs`): a list of strings, not a `datasets` Column.
    assert isinstance(text, list) and all(isinstance(t, str) for t in text), type(text)
    return {
        "pixel_values": torch.zeros(len(images), 3, 64, 64, dtype=torch.uint8),
        "input_ids": torch.ones(len(text), 3, dtype=torch.long),
    }


def test_pointing_counts_the_peak_inside_the_named_object_per_layer_and_family():
    test, boxes = bench.held_out_questions(OPTIONS, images=6)
    model = OracleModel(boxes, test["answer"])
    figures = bench.measure(model, fake_processor, test, boxes, method=None, batch_size=7)
    assert figures["questions"] == 36 and figures["layers"] == ["fusion layer 1", "fusion layer 2"]
    assert figures["per_layer"]["fusion layer 1"] == {f: 1.0 for f in ("non_relational", *bench.FAMILIES)}
    assert figures["per_layer"]["fusion layer 2"]["non_relational"] == 0.0
    assert figures["best_layer"] == "fusion layer 1" and figures["best_non_relational"] == 1.0
    assert figures["answer_accuracy"]["non_relational"] == 1.0
    assert "| attention | fusion layer 2 | 0.000 |" in bench.table(figures)
    # 8 x 8 cells of 8 px: every 10-px object holds a cell's centre, so the grid allows every question.
    assert figures["reachable_non_relational"] == 1.0 and "| (the most this grid allows) |  | 1.000 |" in (
        bench.table(figures)
    )


def test_grid_draws_eight_non_relational_questions_of_distinct_images(tmp_path):
    test, boxes = bench.held_out_questions("num_train_images=4,num_test_images=12,seed=3", images=12)
    picked = bench.grid_examples(test)
    assert len(picked) == 8 and len({test[i]["image_id"] for i in picked}) == 8
    assert {test[i]["question_family"] for i in picked} == set(bench.NON_RELATIONAL)
    bench.draw_grid(OracleModel(boxes, test["answer"]), fake_processor, test, boxes, str(tmp_path / "g.png"), None)
    assert (tmp_path / "g.png").stat().st_size > 10_000


def test_colour_word_positions_find_the_token_that_names_the_colour():
    from mm_fusion.data.sort_of_clevr import vocabulary_texts
    from mm_fusion.tokenizer_training import train_tokenizer

    test, _ = bench.held_out_questions(OPTIONS, images=3)
    tokenizer = train_tokenizer(vocabulary_texts(), vocab_size=100)
    questions = list(test["question"])
    positions = bench.colour_word_positions(tokenizer, questions)
    ids = tokenizer(questions)["input_ids"]
    for question, position, row in zip(questions, positions.tolist(), ids):
        colour = next(c for c in COLOURS if f" {c} " in question)
        assert tokenizer.decode([row[position]]) == colour[: len(tokenizer.decode([row[position]]))] != ""
        assert tokenizer.decode(row[position:]).replace(" ", "").startswith(colour)
    # The families put the colour at different places, so the positions differ.
    assert len(set(positions.tolist())) > 1


class TokenOracle(OracleModel):
    """Its map peaks on the named object only for the token asked for (the colour word), elsewhere for the mean."""

    def image_maps(self, pixel_values, input_ids, attention_mask=None, method=None, token=None):
        result = super().image_maps(pixel_values, input_ids, attention_mask, method)
        if token is None:
            result.maps = result.maps.flip(1)  # the mean: layer 1 off the object
        return result


def test_pointing_with_the_colour_word_passes_its_position_per_question():
    test, boxes = bench.held_out_questions(OPTIONS, images=6)

    class Processor:
        def __init__(self):
            from mm_fusion.data.sort_of_clevr import vocabulary_texts
            from mm_fusion.tokenizer_training import train_tokenizer

            self.tokenizer = train_tokenizer(vocabulary_texts(), vocab_size=100)

        def __call__(self, images, text):
            return fake_processor(images, text)

    processor = Processor()
    word = bench.measure(TokenOracle(boxes, test["answer"]), processor, test, boxes, None, 7, colour_word=True)
    mean = bench.measure(TokenOracle(boxes, test["answer"]), processor, test, boxes, None, 7)
    assert word["token"] == "colour word" and "token" not in mean
    assert word["per_layer"]["fusion layer 1"]["non_relational"] == 1.0
    assert mean["per_layer"]["fusion layer 1"]["non_relational"] == 0.0
    assert "| attention (colour word) | fusion layer 1 | 1.000 |" in bench.table(word)


def test_scene_variants_change_one_object_and_the_counterfactual_counts_what_follows():
    test, boxes = bench.held_out_questions(OPTIONS, images=4)
    shape = test.filter(lambda f: [x == "shape" for x in f], input_columns="question_family", batched=True)
    named_changed, other_changed, follow, stay = bench.scene_variants(shape, object_size=10)
    names = test.features["answer"].names
    shape_boxes = boxes[[i for i, f in enumerate(test["question_family"]) if f == "shape"]]
    for k, (x0, y0, x1, y1) in enumerate(shape_boxes.tolist()):
        before, named = np.asarray(shape[k]["image"].convert("RGB")), np.asarray(named_changed[k])
        inside = np.zeros(before.shape[:2], dtype=bool)
        inside[y0 : y1 + 1, x0 : x1 + 1] = True
        differs = (before != named).any(-1)
        assert differs.any() and not differs[~inside].any()  # only the named object's square changed
        assert not (before != np.asarray(other_changed[k])).any(-1)[inside].any()  # another object's did
        assert names[follow[k]] != names[shape[k]["answer"]] and stay[k] == shape[k]["answer"]

    class Circles:  # answers "circle" to everything
        config = type("Config", (), {"id2label": dict(enumerate(names))})()

        def __call__(self, pixel_values, **kwargs):
            logits = torch.zeros(len(pixel_values), len(names))
            logits[:, names.index("circle")] = 1.0
            return type("Output", (), {"logits": logits})()

    figures = bench.counterfactual(Circles(), fake_processor, test, object_size=10)
    assert figures["questions"] == len(shape) and figures["ignores_another_object"] == 1.0
    assert figures["follows_the_named_object"] == np.mean([names[f] == "circle" for f in follow])
    removal = bench.object_removal(Circles(), fake_processor, test, object_size=10)
    assert set(removal) == {"shape", "horizontal (circle)", "vertical (circle)", "closest", "furthest", "count"}
    assert all(f["named_removed"] == f["other_removed"] == 0.0 for f in removal.values())


def test_deletion_figures_and_the_report_store(tmp_path, monkeypatch):
    at_peak, at_random = np.array([1, 1, 0, 1.0]), np.array([0, 1, 0, 0.0])
    groups = {"all": np.ones(4, dtype=bool), "first": np.array([True, False, False, False])}
    figures = bench.deletion_figures(at_peak, at_random, groups)
    assert figures["all"] == {"at_peak": 0.75, "at_random": 0.25, "ratio": 3.0}
    assert figures["first"]["ratio"] is None  # no random square changed an answer
    monkeypatch.setattr(bench, "RESULTS", tmp_path)
    bench.store("one", {"model": "m", "dataset": "easy_vqa", "questions": 4}, "| a |")
    bench.store("two", {"model": "n", "dataset": "sort_of_clevr"}, "| b |")
    assert set(json.loads((tmp_path / "pointing.json").read_text())) == {"one", "two"}
    assert "## one" in (tmp_path / "pointing.md").read_text() and "| b |" in (tmp_path / "pointing.md").read_text()
