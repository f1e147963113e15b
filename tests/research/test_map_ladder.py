"""scripts/research/map_ladder.py: its candidate maps of a model whose tower reads the question, scored per family;
the stage-1 read-weighted candidate is the library's default map."""

import json

import map_ladder  # scripts/research is on sys.path (conftest.py)
import torch

import mm_fusion
from mm_fusion import MMFusionForImageTextClassification


OPTIONS = "num_train_images=4,num_test_images=6,seed=3"


def test_the_ladder_scores_every_candidate_and_its_stage_1_map_is_the_librarys(tester, tmp_path, monkeypatch):
    monkeypatch.setattr(map_ladder, "recipe_dataset_options", lambda: OPTIONS)
    test, _ = map_ladder.held_out_questions(OPTIONS, 3)
    torch.manual_seed(0)
    config = tester.config("hierarchical", vision_config=tester.resnet_config(), vision_text_attention=True)
    MMFusionForImageTextClassification(config).save_pretrained(tmp_path)
    tokenizer = mm_fusion.train_tokenizer(list(test["question"]), vocab_size=60)
    image_processor = mm_fusion.MMFusionImageProcessor(size={"height": tester.image_size, "width": tester.image_size})
    mm_fusion.MMFusionProcessor(image_processor, tokenizer).save_pretrained(tmp_path)

    output = tmp_path / "ladder.json"
    output.write_text(json.dumps({"another model": {"maps": {}}}))
    argv = ["--model", str(tmp_path), "--images", "3", "--output", str(output), "--name", "tiny"]
    report = map_ladder.main([*argv, "--path_alphas", "0.5,1", "--heads"])
    non_relational = [f for f in test["question_family"] if f in map_ladder.NON_RELATIONAL]
    assert report["questions"] == len(non_relational) > 0
    stored = json.loads(output.read_text())
    assert stored["tiny"]["maps"] == report["maps"] and "another model" in stored  # stored beside the others
    faded = {"input x gradient at 0.5", "input x gradient averaged over 0.5,1", "input x gradient at 1"}
    assert faded | {f"{name} x attention" for name in faded} <= set(report["maps"])
    heads = config.fusion_num_attention_heads
    assert sum(name.startswith("head ") for name in report["maps"]) == 4 * heads  # four candidates a head
    assert {f"all heads: |{path} . gradient|" for path in ("key", "value")} <= set(report["maps"])
    stages = [name for name in report["maps"] if name.startswith("stage ")]
    assert len(stages) == 5 * 2  # five candidates for each of the tiny tower's two reading stages
    split = {f"{family} ({answer})" for family in ("horizontal", "vertical") for answer in ("yes", "no")}
    for entry in report["maps"].values():
        assert set(entry) == {"non_relational", *map_ladder.NON_RELATIONAL, *split}
        assert all(value is None or 0.0 <= value <= 1.0 for value in entry.values())
        for family in ("horizontal", "vertical"):  # a family's figure is the mean of its yes and no questions'
            parts = [entry[f"{family} ({answer})"] for answer in ("yes", "no")]
            parts = [part for part in parts if part is not None]
            assert parts and min(parts) - 1e-4 <= entry[family] <= max(parts) + 1e-4

    model, processor = map_ladder.load(str(tmp_path))
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    rows = test[:6]
    maps, _ = map_ladder.batch_maps(model, processor, rows)
    library = model.image_maps(**processor(images=rows["image"], text=rows["question"])).maps[:, 0]
    ours = maps["stage 1: ... x |read . gradient|"]
    torch.testing.assert_close(ours / ours.sum((-1, -2), keepdim=True), library)
    # the path's end point is the image itself: its gradient is the ladder's input x gradient
    faded = map_ladder.path_maps(model, processor, rows, [1.0, 0.5])
    torch.testing.assert_close(faded["input x gradient at 1"], maps["input x gradient"])
    assert not torch.allclose(faded["input x gradient at 0.5"], maps["input x gradient"])
    # the heads' attention, averaged, is the library's attention map of the last fusion layer
    per_head = map_ladder.head_maps(model, processor, rows)
    mean = torch.stack([per_head[f"head {h}: attention (question mean)"] for h in range(heads)]).mean(0)
    attention = model.image_maps(**processor(images=rows["image"], text=rows["question"]), method="attention")
    torch.testing.assert_close(mean, map_ladder.upsample(attention.maps[:, -1], mean.shape[-2:]))
    value = per_head["all heads: |value . gradient|"]
    assert value.shape == mean.shape and value.sum() > 0
