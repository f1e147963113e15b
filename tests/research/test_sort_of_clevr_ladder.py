"""scripts/research/sort_of_clevr_ladder.py: its questions, its accuracy count, and a tiny run of every contender."""

import json

import pytest
import sort_of_clevr_ladder as ladder  # scripts/research is on sys.path (conftest.py)
import torch

from mm_fusion.data.sort_of_clevr import answer_question, generate_scenes


def scenes(n: int):
    return generate_scenes(
        num_train_images=n, num_test_images=0, num_objects=6, image_size=64, object_size=10, min_distance_gap=2.0,
        seed=3,
    )["train"]  # fmt: skip


def test_split_asks_every_colour_and_family_with_the_generator_answers():
    drawn = scenes(2)
    split = ladder.build_split(drawn)
    assert split["images"].shape == (2, 3, 64, 64) and 0 <= split["images"].min() and split["images"].max() <= 1
    assert len(split["answer"]) == 2 * 6 * 6
    for row in (0, 17, 71):
        image, colour, family = (int(split[k][row]) for k in ("image", "colour", "family"))
        expected = answer_question(drawn[image], ladder.FAMILIES[family], ladder.COLOUR_NAMES[colour], 64)
        assert ladder.ANSWERS[int(split["answer"][row])] == expected
    question = ladder.one_hot_question(split["colour"][:3], split["family"][:3])
    assert question.shape == (3, 12) and question.sum(1).tolist() == [2.0, 2.0, 2.0]


class AlwaysYes(torch.nn.Module):
    def forward(self, images, question):
        logits = torch.zeros(len(question), len(ladder.ANSWERS))
        logits[:, ladder.ANSWERS.index("yes")] = 1.0
        return logits


def test_evaluate_counts_per_family():
    drawn = scenes(5)
    split = ladder.build_split(drawn)
    result = ladder.evaluate(AlwaysYes(), split)
    left = [answer_question(s, "horizontal", c, 64) == "yes" for s in drawn for c in ladder.COLOUR_NAMES]
    assert result["horizontal"] == round(sum(left) / len(left), 4)
    assert result["shape"] == result["closest"] == result["count"] == 0.0
    assert result["non_relational"] == round((result["horizontal"] + result["vertical"]) / 3, 4)


def test_tiny_run_of_every_variant_and_merge(tmp_path):
    threads = torch.get_num_threads()
    first, second = tmp_path / "a", tmp_path / "b"
    common = ["--steps", "2", "--eval_every", "1", "--train_images", "4", "--test_images", "2"]
    ladder.main(["--variants", *ladder.VARIANTS[:5], "--output", str(first), *common])
    ladder.main(["--variants", *ladder.VARIANTS[5:], "--output", str(second), *common])
    merged = ladder.main(["--merge", f"{first}.json", f"{second}.json", "--output", str(tmp_path / "all")])
    assert [r["variant"] for r in merged["runs"]] == list(ladder.VARIANTS)
    relational = [f for f in ladder.FAMILIES if f not in ladder.NON_RELATIONAL]
    for run in merged["runs"]:
        assert [e["step"] for e in run["evaluations"]] == [1, 2]
        last = run["evaluations"][-1]
        # 2 test images x 6 colours: each family's accuracy counts 12 questions, and `relational` is their mean.
        for family in ladder.FAMILIES:
            assert last[family] * 12 == pytest.approx(round(last[family] * 12), abs=0.01), (run["variant"], family)
        mean = sum(last[f] for f in relational) / len(relational)
        assert last["relational"] == pytest.approx(mean, abs=1e-4), run["variant"]
    assert json.loads((tmp_path / "all.json").read_text())["runs"] == merged["runs"]
    table = (tmp_path / "all.md").read_text()
    assert all(f"| {name} | 2 |" in table for name in ladder.VARIANTS)
    assert (tmp_path / "all.png").stat().st_size > 0  # the learning curves
    assert torch.get_num_threads() == threads  # --threads applies to the run only
    # Another seed of a variant is a run of its own, next to the first, not in its place.
    ladder.main(["--variants", "film", "--seed", "1", "--output", str(tmp_path / "seed1"), *common])
    both = ladder.main(["--merge", f"{tmp_path / 'all'}.json", f"{tmp_path / 'seed1'}.json", "--output", str(first)])
    names = [ladder.run_name(r) for r in both["runs"]]
    assert names[names.index("film") + 1] == "film (seed 1)" and len(names) == len(ladder.VARIANTS) + 1


def test_colour_probe_reads_the_colour_off_the_stem_and_less_off_the_last_stage():
    probe = ladder.colour_probe(seed=1, images=60)
    assert list(probe) == ["two convs (16 x 16)", "ResNet stem (16 x 16)", "ResNet stage 1 (16 x 16)",
                           "ResNet stage 2 (8 x 8)", "ResNet stage 3 (4 x 4)"]  # fmt: skip
    assert probe["ResNet stem (16 x 16)"] >= 0.9 > probe["ResNet stage 3 (4 x 4)"]


class FixedMaps(torch.nn.Module):
    """Answers nothing; its text-to-image attention is the map it is given (one layer)."""

    def __init__(self, maps):
        super().__init__()
        self.maps = maps

    def forward(self, images, question):
        return torch.zeros(len(question), len(ladder.ANSWERS))

    def attention_maps(self, images, question):
        return self.maps[: len(question)]


def test_attention_on_object_is_one_on_the_named_object_and_its_area_when_uniform():
    drawn = scenes(20)
    split = ladder.build_split(drawn)
    named = torch.isin(split["family"], torch.tensor([ladder.FAMILIES.index(f) for f in ladder.NON_RELATIONAL]))
    rows = torch.nonzero(named)[:600, 0]
    for row in rows[:5]:  # the centre is the named object's, from the scene
        image, colour = int(split["image"][row]), ladder.COLOUR_NAMES[int(split["colour"][row])]
        (drawn_object,) = [o for o in drawn[image] if o["colour"] == colour]
        assert split["centre"][row].tolist() == [drawn_object["x"], drawn_object["y"]]
    centre = split["centre"][rows]
    on = torch.zeros(len(rows), 1, 16, 16)
    on[torch.arange(len(rows)), 0, (centre[:, 1] // 4).long(), (centre[:, 0] // 4).long()] = 1.0
    families = [f"on_object_{f}" for f in ladder.NON_RELATIONAL]
    assert ladder.attention_on_object(FixedMaps(on), split) == dict.fromkeys(["on_object", *families], 1.0)
    # On the object for shape questions only: the families are told apart (the average alone hid that split).
    shape_only = on * (split["family"][rows] == ladder.FAMILIES.index("shape")).float()[:, None, None, None]
    by_family = ladder.attention_on_object(FixedMaps(shape_only), split)
    assert [by_family[k] for k in families] == [1.0, 0.0, 0.0]
    assert by_family["on_object"] == pytest.approx(1 / 3, abs=0.01)
    # All of it on another colour's object: none on the named one (objects do not overlap).
    other = torch.zeros_like(on)
    for k, row in enumerate(rows):
        image, colour = int(split["image"][row]), ladder.COLOUR_NAMES[int(split["colour"][row])]
        x, y = next((o["x"], o["y"]) for o in drawn[image] if o["colour"] != colour)
        other[k, 0, int(y // 4), int(x // 4)] = 1.0
    assert set(ladder.attention_on_object(FixedMaps(other), split).values()) == {0.0}
    uniform = ladder.attention_on_object(FixedMaps(torch.full((len(rows), 1, 16, 16), 1 / 256)), split)
    # About a 10 px square's share of 64 x 64 (2.4%), cells counted whole.
    assert all(0.02 < share < 0.04 for share in uniform.values())
    assert "on_object" in ladder.evaluate(FixedMaps(on), split) and "on_object" not in ladder.evaluate(
        AlwaysYes(), split
    )


def test_coordinate_stem_keeps_the_colour_weights_and_adds_a_function_of_position_only():
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 8, 7, stride=2, padding=3)
    stem = ladder.CoordinateStem(conv)
    pixels = torch.rand(2, 3, 64, 64)
    added = stem(pixels) - conv(pixels)
    # What the coordinate channels add depends on where a cell is, not on the image: the same for both images,
    # and for a black image, and not zero (the position does reach the features).
    assert torch.allclose(added[0], added[1], atol=1e-5)
    assert torch.allclose(added, stem(torch.zeros_like(pixels)) - conv(torch.zeros_like(pixels)), atol=1e-5)
    assert added.abs().mean() > 0.01
    # Zero coordinate weights give back the convolution it replaced.
    with torch.no_grad():
        stem.conv.weight[:, 3:] = 0
    assert torch.allclose(stem(pixels), conv(pixels), atol=1e-6)


def test_a_report_of_many_seeds_is_drawn_one_panel_per_variant(tmp_path, monkeypatch):
    evaluation = {"step": 500, "seconds": 1.0, "non_relational": 0.5, "relational": 0.5}
    evaluation |= dict.fromkeys(ladder.FAMILIES, 0.5)
    runs = [
        {"variant": "attention", "evaluations": [evaluation], "settings": {"seed": seed, "steps": 500}}
        for seed in range(3)
    ]
    report = tmp_path / "seeds.json"
    report.write_text(json.dumps({"runs": runs}))
    drawn = []
    monkeypatch.setattr(ladder, "plot_by_variant", lambda runs, path: drawn.append(("by variant", len(runs))))
    monkeypatch.setattr(ladder, "plot", lambda runs, path: drawn.append(("groups", len(runs))))
    ladder.main(["--merge", str(report), "--output", str(tmp_path / "merged")])
    assert drawn[0] == ("by variant", 3)
    report.write_text(json.dumps({"runs": runs[:2]}))  # two seeds: the groups of contenders, as before
    ladder.main(["--merge", str(report), "--output", str(tmp_path / "two")])
    assert drawn[-1] == ("groups", 2)
    monkeypatch.undo()
    ladder.plot_by_variant(runs, tmp_path / "drawn.png")
    assert (tmp_path / "drawn.png").stat().st_size > 10_000
