"""FiLM: a backbone / convolutional vision tower conditioned on the text (`MMFusionConfig.vision_film`)."""

import copy

import pytest
import torch

from mm_fusion import MMFusionConfig, MMFusionForImageTextClassification, MMFusionForPretraining, MMFusionModel
from mm_fusion.vision_towers import MMFusionFiLMLinear, film_stages


def film_config(tester, tower: str = "resnet", fusion_type: str = "hierarchical", **kwargs) -> MMFusionConfig:
    vision = tester.resnet_config() if tower == "resnet" else tester.mobilenet_config()
    return tester.config(fusion_type, vision_config=vision, **{"vision_film": True, **kwargs})


def randomise_film(model: torch.nn.Module, seed: int = 0) -> None:
    """Trained-like FiLM maps (they start at zero)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, MMFusionFiLMLinear):
                module.weight.copy_(torch.randn(module.weight.shape, generator=g) * 0.2)
                module.bias.copy_(torch.randn(module.bias.shape, generator=g) * 0.2)


def test_film_maps_every_stage_after_the_stem(tester):
    resnet = MMFusionModel(film_config(tester))
    # ResNet: stem, stage1 (8 channels), stage2 (16): one scale and one shift per channel of each stage after the stem.
    assert [layer.out_features for layer in resnet.vision_encoder.vision_film.maps] == [16, 32]
    assert film_stages(resnet.vision_model, resnet.config.vision_config) is resnet.vision_model.encoder.stages
    mobilenet = MMFusionModel(film_config(tester, "mobilenet", "late"))
    assert len(mobilenet.vision_encoder.vision_film.maps) == 16  # every hidden_states map of MobileNetV2
    assert film_stages(mobilenet.vision_model, mobilenet.config.vision_config) is mobilenet.vision_model.layer
    assert all(not p.detach().any() for p in resnet.vision_encoder.vision_film.parameters())  # starts as the identity


@pytest.mark.parametrize("fusion_type", ["hierarchical", "late"])
def test_film_starts_as_the_unconditioned_model(tester, fusion_type):
    """At initialisation the FiLM maps are zero: the same weights give the same outputs with and without FiLM."""
    plain = MMFusionForImageTextClassification(film_config(tester, fusion_type=fusion_type, vision_film=False)).eval()
    film = MMFusionForImageTextClassification(film_config(tester, fusion_type=fusion_type)).eval()
    missing, unexpected = film.load_state_dict(plain.state_dict(), strict=False)
    assert unexpected == [] and missing and all(".vision_film." in name for name in missing)
    inputs = tester.inputs()
    with torch.no_grad():
        torch.testing.assert_close(film(**inputs).logits, plain(**inputs).logits)
        randomise_film(film)
        assert not torch.allclose(film(**inputs).logits, plain(**inputs).logits, atol=1e-4)


def check_each_image_conditioned_on_its_own_text(model, inputs: dict) -> None:
    """Two texts about one image (`image_index`) see different tower features, each the same as that pair run alone
    and unlike the unconditioned tower's; the tower runs once per text."""
    index = torch.tensor([1, 1, 0])
    with torch.no_grad():
        shared = model(**inputs, image_index=index, output_hidden_states=True)
        paired = model(**{**inputs, "pixel_values": inputs["pixel_values"][index]}, output_hidden_states=True)
        unconditioned, _ = model.mm_fusion.vision_encoder(inputs["pixel_values"][index], output_hidden_states=True)
    last = shared.vision_hidden_states[-1]
    assert last.shape[0] == 3  # one tower run per text
    assert not torch.allclose(last[0], last[1], atol=1e-4)  # same image, different texts
    assert not torch.allclose(last, unconditioned.hidden_states[-1], atol=1e-4)  # the text changes the tower
    torch.testing.assert_close(last, paired.vision_hidden_states[-1])
    torch.testing.assert_close(shared.logits, paired.logits)


def test_film_conditions_each_image_on_its_own_text(tester):
    model = MMFusionForImageTextClassification(film_config(tester, fusion_type="cross_attention")).eval()
    randomise_film(model)
    check_each_image_conditioned_on_its_own_text(model, tester.inputs())  # 3 texts, 3 images


def test_film_trains_saves_and_reloads(tester, tmp_path):
    config = film_config(tester, "mobilenet", "hierarchical", vision_bridge_layers=[5, 15])
    model = MMFusionForImageTextClassification(config).train()
    inputs = tester.inputs()
    model(**inputs, labels=torch.tensor([0, 1, 2])).loss.backward()
    grads = [layer.weight.grad for layer in model.mm_fusion.vision_encoder.vision_film.maps]
    assert all(g is not None for g in grads) and sum(float(g.abs().sum()) for g in grads) > 0
    randomise_film(model)
    model.eval()
    copied = copy.deepcopy(model)  # its hooks modulate through its own FiLM maps, not the original's
    with torch.no_grad():
        expected = model(**inputs).logits
        torch.testing.assert_close(copied(**inputs).logits, expected)
        for p in model.mm_fusion.vision_encoder.vision_film.parameters():
            p.zero_()
        torch.testing.assert_close(copied(**inputs).logits, expected)
        randomise_film(model)
    model.save_pretrained(tmp_path)
    reloaded = MMFusionForImageTextClassification.from_pretrained(tmp_path).eval()
    assert reloaded.config.vision_film is True
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**inputs).logits, model(**inputs).logits)


def test_film_refuses_what_needs_an_image_without_its_text(tester):
    with pytest.raises(ValueError, match="vision_film scales and shifts .* the ViTConfig tower is a transformer"):
        tester.config(vision_film=True)
    check_refuses_an_image_without_its_text(film_config(tester), tester.inputs())


def check_refuses_an_image_without_its_text(config: MMFusionConfig, inputs: dict) -> None:
    """A tower conditioned on the text gives no image embedding apart from a text: what needs one says so."""
    with pytest.raises(ValueError, match="contrastive loss needs an embedding per image"):
        MMFusionForPretraining(copy.deepcopy(config))
    model = MMFusionModel(config)
    with pytest.raises(ValueError, match="an image has no embedding without a text"):
        model.get_image_features(inputs["pixel_values"])
    with pytest.raises(ValueError, match="images have no features apart from a text"):
        model.encode(**inputs)


def outside_the_towers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The linear and convolution layers of the fusion block, token projections, projections and heads (not FiLM)."""
    base = model.mm_fusion
    towers = {id(m) for tower in (base.vision_model, base.text_model) for m in tower.modules()}
    return [
        m
        for m in model.modules()
        if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))
        and not isinstance(m, MMFusionFiLMLinear)
        and id(m) not in towers
    ]


@pytest.mark.parametrize("fusion_type", ["hierarchical", "late"])
def test_pytorch_draws_of_the_film_maps_and_the_layers_outside_the_towers(tester, fusion_type, tmp_path):
    """`init_scheme="pytorch"` draws the FiLM maps and the layers outside the towers as a new `nn.Linear` /
    `nn.Conv2d` is drawn (uniform within 1 / sqrt(fan-in), biases too); the default keeps zero FiLM maps and N(0,
    initializer_range) with zero biases. A saved model keeps the choice and loads its weights as saved."""
    torch.manual_seed(0)
    default = MMFusionForImageTextClassification(film_config(tester, fusion_type=fusion_type))
    torch.manual_seed(0)
    drawn = MMFusionForImageTextClassification(film_config(tester, fusion_type=fusion_type, init_scheme="pytorch"))
    for layer in drawn.mm_fusion.vision_encoder.vision_film.maps:
        bound = 1 / layer.in_features**0.5
        assert layer.weight.abs().max() <= bound and layer.weight.std() > bound / 3  # uniform: std = bound / sqrt 3
        assert layer.bias.abs().max() <= bound and layer.bias.any()
    assert all(not p.any() for p in default.mm_fusion.vision_encoder.vision_film.parameters())
    layers = outside_the_towers(drawn)
    assert any(isinstance(m, torch.nn.Conv2d) for m in layers)  # the feature-map tokens' 1x1 projections
    for layer, normal in zip(layers, outside_the_towers(default)):
        bound = 1 / layer.weight[0].numel() ** 0.5
        assert layer.weight.abs().max() <= bound, layer
        if layer.weight.numel() >= 256:  # enough draws to tell the two apart
            assert layer.weight.std() > 2 * tester.config().initializer_range > normal.weight.std(), layer
        if layer.bias is not None:
            assert layer.bias.abs().max() <= bound and layer.bias.any() and not normal.bias.any(), layer
    drawn.save_pretrained(tmp_path)
    reloaded = MMFusionForImageTextClassification.from_pretrained(tmp_path)
    assert reloaded.config.init_scheme == "pytorch"
    for name, value in drawn.state_dict().items():
        torch.testing.assert_close(reloaded.state_dict()[name], value, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"init_scheme": "xavier"}, "Unknown init_scheme 'xavier'; valid values are normal, pytorch"),
        ({"vision_film_init": "ones"}, "Unknown vision_film_init 'ones'; valid values are zeros, pytorch"),
        ({"fusion_init": "xavier"}, "Unknown fusion_init 'xavier'; valid values are normal, pytorch"),
        ({"init_scheme": "normal", "fusion_init": "pytorch"}, "init_scheme replaces the two, give it alone"),
    ],
)
def test_unknown_initialisations_are_refused(tester, bad, message):
    with pytest.raises(ValueError, match=message):
        film_config(tester, **bad)


@pytest.mark.parametrize(
    "earlier, scheme",
    [
        ({"vision_film_init": "zeros", "fusion_init": "normal"}, "normal"),
        ({"vision_film_init": "pytorch", "fusion_init": "pytorch"}, "pytorch"),
        ({"vision_film_init": "zeros", "fusion_init": "pytorch"}, "pytorch"),
        ({"fusion_init": "pytorch"}, "pytorch"),
        ({"vision_film_init": "zeros"}, "normal"),
    ],
)
def test_the_two_earlier_initialisation_settings_load_as_one_scheme(tester, earlier, scheme):
    """A config saved with `vision_film_init` / `fusion_init` loads with the `init_scheme` they amount to, and saves
    that alone."""
    saved = {k: v for k, v in film_config(tester).to_dict().items() if k != "init_scheme"}  # as saved before it
    config = MMFusionConfig.from_dict({**saved, **earlier})
    assert config.init_scheme == scheme
    assert "init_scheme" in config.to_dict() and not {"vision_film_init", "fusion_init"} & config.to_dict().keys()
