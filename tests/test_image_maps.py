"""Where a model looks: `MMFusionForImageTextClassification.image_maps` (the gradient maps, attention and Grad-CAM)
and the pointing checks."""

import copy

import pytest
import torch
import torch.nn.functional as F

from mm_fusion import MMFusionForImageTextClassification
from mm_fusion.image_maps import pixel_contributions, smoothing_window, upsample
from mm_fusion.map_scoring import deletion_test, foreground_masks, paint, peak_inside, peak_on, reachable


def classifier(tester, fusion_type: str, tower: str, **kwargs) -> MMFusionForImageTextClassification:
    torch.manual_seed(0)
    vision = {"vit": tester.vision_config(), "resnet": tester.resnet_config()}[tower]
    return MMFusionForImageTextClassification(tester.config(fusion_type, vision_config=vision, **kwargs)).eval()


@pytest.mark.parametrize("fusion_type", ["hierarchical", "cross_attention"])
@pytest.mark.parametrize("tower", ["vit", "resnet"])
def test_attention_maps_are_the_probabilities_the_model_attends_with(tester, fusion_type, tower):
    """Under SDPA (no probabilities returned) the maps equal the eager implementation's text-to-image probabilities,
    averaged over heads and the text's real tokens; a ViT's class token is reported apart, the rest on the grid."""
    model = classifier(tester, fusion_type, tower)
    inputs = tester.inputs()
    result = model.image_maps(**inputs, method="attention")
    assert result.method == "attention" and result.layers == ["fusion layer 1", "fusion layer 2"]
    eager = copy.deepcopy(model)
    eager.config._attn_implementation = {"": "eager"}  # the fusion only; the towers keep theirs
    with torch.no_grad():
        outputs = eager(**inputs, output_attentions=True)
    mask = inputs["attention_mask"].float()
    for layer, probabilities in enumerate(outputs.text_to_image_attentions):
        expected = (probabilities * mask[:, None, :, None]).sum(2).mean(1) / mask.sum(1, keepdim=True)
        leading = 1 if tower == "vit" else 0
        grid = result.maps[:, layer]
        assert expected.shape[-1] == grid[0].numel() + leading
        torch.testing.assert_close(grid.flatten(1), expected[:, leading:])
        torch.testing.assert_close(result.leading_share[:, layer], expected[:, :leading].sum(-1))
        torch.testing.assert_close(grid.sum((-1, -2)) + result.leading_share[:, layer], torch.ones(3))
    torch.testing.assert_close(result.logits, outputs.logits)
    # One token's attention instead of the mean.
    one = model.image_maps(**inputs, method="attention", token=1)
    first = outputs.text_to_image_attentions[0][:, :, 1].mean(1)
    torch.testing.assert_close(one.maps[:, 0].flatten(1), first[:, 1 if tower == "vit" else 0 :])
    # One position per pair: each pair's map is that pair's token's.
    positions = torch.tensor([2, 0, 1])
    each = model.image_maps(**inputs, method="attention", token=positions)
    own = outputs.text_to_image_attentions[0][torch.arange(3), :, positions].mean(1)
    torch.testing.assert_close(each.maps[:, 0].flatten(1), own[:, 1 if tower == "vit" else 0 :])
    torch.testing.assert_close(each.maps[1], model.image_maps(**inputs, method="attention", token=0).maps[1])


def test_input_x_gradient_is_the_first_order_change_of_giving_pixels_the_median_colour(tester):
    """The signed contributions sum, over any set of pixels, to the rate at which the answer's logit falls as those
    pixels move towards the image's median colour (a central difference, in float64); the map is their magnitude
    summed over a window and scaled to 1."""
    model = classifier(tester, "hierarchical", "resnet").double()
    inputs = tester.inputs()
    pixels = inputs["pixel_values"].double()  # float pixels are taken as normalised
    inputs["pixel_values"] = pixels
    model.mm_fusion.text_model.requires_grad_(False)  # a frozen tower stays frozen, the rest trainable
    trainable = [p.requires_grad for p in model.parameters()]
    contributions, logits, answers = pixel_contributions(model, inputs)
    assert contributions.shape == (3, 30, 30) and torch.equal(answers, logits.argmax(-1))
    assert [p.requires_grad for p in model.parameters()] == trainable and any(trainable) and not all(trainable)
    median = pixels.flatten(2).median(-1).values[..., None, None]
    patch = torch.zeros(1, 1, 30, 30, dtype=torch.float64)
    patch[..., 4:12, 10:20] = 1.0

    def logit(step: float) -> torch.Tensor:
        moved = pixels + step * (median - pixels) * patch
        with torch.no_grad():
            return model(**{**inputs, "pixel_values": moved}).logits.gather(1, answers[:, None])[:, 0]

    step = 1e-4
    falls = -(logit(step) - logit(-step)) / (2 * step)
    torch.testing.assert_close(falls, (contributions * patch[0]).sum((-1, -2)), rtol=1e-5, atol=1e-8)
    result = model.image_maps(**inputs, method="input_x_gradient")
    assert result.method == "input_x_gradient" and result.layers == ["input x gradient"]
    window = smoothing_window((30, 30))
    summed = F.avg_pool2d(contributions.abs()[:, None], window, 1, window // 2, count_include_pad=False)[:, 0]
    torch.testing.assert_close(result.maps[:, 0], summed / summed.sum((-1, -2), keepdim=True).float())
    other = (answers + 1) % tester.num_labels  # another answer, another map
    assert not torch.allclose(model.image_maps(**inputs, method="input_x_gradient", targets=other).maps, result.maps)
    assert all(p.grad is None for p in model.parameters())  # the model is left as it was


def test_gradient_maps_are_zero_on_a_plain_background(tester):
    """Pixels of the image's median colour contribute nothing: on a plain background with one square, the map is 0
    wherever its window holds none of the square."""
    model = classifier(tester, "hierarchical", "resnet")
    inputs = tester.inputs()
    image = torch.full((3, 3, 30, 30), 200, dtype=torch.uint8)
    image[:, 0, 10:16, 12:18] = 30  # a square of another colour
    result = model.image_maps(**{**inputs, "pixel_values": image}, method="input_x_gradient")
    half = smoothing_window((30, 30)) // 2
    near = torch.zeros(30, 30, dtype=torch.bool)
    near[10 - half : 16 + half, 12 - half : 18 + half] = True
    assert (result.maps[:, 0, ~near] == 0).all() and (result.maps[:, 0, near] > 0).any(-1).all()
    assert peak_on(result.maps[:, 0], near.expand(3, -1, -1)).all()


@pytest.mark.parametrize("fusion_type", ["hierarchical", "late"])
def test_guided_gradient_weights_the_pixels_by_the_models_coarse_map(tester, fusion_type):
    """The default map: input x gradient weighted by the last fusion layer's attention (by Grad-CAM for late
    fusion), put on the pixels bilinearly, summed over the window and scaled to 1; every answer gets its own."""
    model = classifier(tester, fusion_type, "resnet")
    inputs = tester.inputs()
    result = model.image_maps(**inputs, method="guided_gradient")
    assert result.method == "guided_gradient"
    default = model.image_maps(**inputs).method  # late fusion's default is the pixels alone: it points better
    assert default == ("input_x_gradient" if fusion_type == "late" else "guided_gradient")
    coarse = "Grad-CAM on the vision stage 2" if fusion_type == "late" else "fusion layer 2's attention"
    assert result.layers == [f"input x gradient x {coarse}"]
    contributions, logits, answers = pixel_contributions(model, inputs)
    torch.testing.assert_close(result.logits, logits)
    method = "grad_cam" if fusion_type == "late" else "attention"
    weights = upsample(model.image_maps(**inputs, method=method).maps[:, -1], (30, 30))
    window = smoothing_window((30, 30))
    summed = F.avg_pool2d((contributions.abs() * weights)[:, None], window, 1, window // 2, count_include_pad=False)
    torch.testing.assert_close(result.maps[:, 0], summed[:, 0] / summed.sum((-1, -2), keepdim=True)[:, 0])
    other = model.image_maps(**inputs, method="guided_gradient", targets=(answers + 1) % tester.num_labels)
    assert not torch.allclose(other.maps, result.maps)


def test_guided_gradient_of_a_reading_tower_weights_by_where_its_first_read_moves_the_answer(tester):
    """For a tower whose stages read the question, the default map also weights the pixels by where the first stage's
    read moves the answer: per cell, |read . dlogit/dread|, the read taken from the read module's own output."""
    model = classifier(tester, "hierarchical", "resnet", vision_text_attention=True)
    inputs = tester.inputs()
    result = model.image_maps(**inputs)
    assert result.method == "guided_gradient"
    assert result.layers == ["input x gradient x fusion layer 2's attention x the tower's first read x its gradient"]
    first = model.mm_fusion.vision_encoder.vision_text_attention.reads[0]
    seen = []
    handle = first.register_forward_hook(lambda module, args, output: seen.append((args[0], output)))
    try:
        with torch.enable_grad():
            logits = model(**inputs).logits
            hidden, output = seen[0]
            (gradient,) = torch.autograd.grad(logits.gather(1, logits.argmax(-1, keepdim=True)).sum(), output)
    finally:
        handle.remove()
    read = ((output - hidden).detach() * gradient).sum(1).abs()  # (N, 8, 8): stage 1's grid
    assert read.shape == (3, 8, 8) and (read > 0).any()
    contributions, _, _ = pixel_contributions(model, inputs)
    attention = upsample(model.image_maps(**inputs, method="attention").maps[:, -1], (30, 30))
    window = smoothing_window((30, 30))
    evidence = contributions.abs() * attention * upsample(read, (30, 30))
    summed = F.avg_pool2d(evidence[:, None], window, 1, window // 2, count_include_pad=False)[:, 0]
    torch.testing.assert_close(result.maps[:, 0], summed / summed.sum((-1, -2), keepdim=True))
    assert model.mm_fusion.vision_encoder.vision_text_attention.read_outputs is None  # the model is left as it was
    alone = model.image_maps(**inputs, method="input_x_gradient")  # the pixels alone: no coarse map, no read
    assert alone.layers == ["input x gradient"]


def test_maps_of_texts_sharing_an_image(tester):
    """Texts that share an image through `image_index` get the maps they get with their own copy of it."""
    cases = [("hierarchical", m) for m in ("attention", "grad_cam", "input_x_gradient", "guided_gradient")]
    for fusion_type, method in [*cases, ("late", "grad_cam"), ("late", "guided_gradient")]:
        model = classifier(tester, fusion_type, "resnet")
        inputs = tester.inputs()
        image_index = torch.tensor([0, 0, 1])
        shared = model.image_maps(**{**inputs, "pixel_values": inputs["pixel_values"][:2]}, image_index=image_index,
                                  method=method)  # fmt: skip
        own = model.image_maps(**{**inputs, "pixel_values": inputs["pixel_values"][image_index]}, method=method)
        torch.testing.assert_close(shared.maps, own.maps)
        assert not torch.allclose(shared.maps[0], shared.maps[2])  # another image, another map


def test_grad_cam_explains_the_answer_asked_for(tester):
    model = classifier(tester, "late", "resnet")
    inputs = tester.inputs()
    top = model.image_maps(**inputs, method="grad_cam")
    assert top.method == "grad_cam" and top.layers == ["Grad-CAM, vision stage 2"]
    assert torch.equal(top.targets, top.logits.argmax(-1))
    assert top.maps.shape == (3, 1, 4, 4) and (top.maps >= 0).all()
    torch.testing.assert_close(top.maps.sum((-1, -2)), torch.ones(3, 1))
    other = (top.targets + 1) % tester.num_labels
    again = model.image_maps(**inputs, method="grad_cam", targets=other)
    assert torch.equal(again.targets, other) and not torch.allclose(again.maps, top.maps)
    assert all(p.grad is None for p in model.parameters())  # the model is left as it was


def test_grad_cam_of_a_film_model_follows_the_question(tester):
    """With FiLM the tower's map is the text's: the same image asked two things gets two maps."""
    model = classifier(tester, "late", "resnet", vision_film=True, init_scheme="pytorch")
    inputs = tester.inputs()
    pixel_values = inputs["pixel_values"][:1].expand(3, -1, -1, -1)
    result = model.image_maps(**{**inputs, "pixel_values": pixel_values}, method="grad_cam")
    assert not torch.allclose(result.maps[0], result.maps[1])


def test_tower_attention_maps_are_the_attention_the_cells_give_the_token(tester):
    """A tower conditioned by cross-attention (`vision_text_attention`): per stage after the stem, the share of each
    cell's attention on the chosen token, from the read's own projections (heads averaged), summing to 1 over the grid;
    the coarser stage on the first stage's grid."""
    model = classifier(tester, "hierarchical", "resnet", vision_text_attention=True)
    inputs = tester.inputs()
    reads = model.mm_fusion.vision_encoder.vision_text_attention.reads
    seen = []
    handles = [r.register_forward_pre_hook(lambda module, args: seen.append((module, args))) for r in reads]
    positions = torch.tensor([2, 0, 1])
    try:
        result = model.image_maps(**inputs, method="tower_attention", token=positions)
    finally:
        for handle in handles:
            handle.remove()
    assert result.method == "tower_attention" and result.layers == ["vision stage 1 read", "vision stage 2 read"]
    assert result.maps.shape == (3, 2, 8, 8)  # stage 1 is 8 x 8, stage 2 (4 x 4) put on its grid
    torch.testing.assert_close(result.maps.sum((-1, -2)), torch.ones(3, 2))
    module, (hidden, text, mask) = seen[0]
    assert module is reads[0] and hidden.shape[-2:] == (8, 8)
    heads = module.num_heads
    cells = torch.nn.functional.layer_norm(hidden.flatten(2).transpose(1, 2), (hidden.shape[1],), module.norm.weight,
                                           module.norm.bias)  # fmt: skip
    query = module.query(cells).unflatten(-1, (heads, -1))  # (N, cells, heads, size)
    key = module.key(text).unflatten(-1, (heads, -1))  # (N, tokens, heads, size)
    scores = torch.einsum("nchd,nthd->nhct", query, key) / query.shape[-1] ** 0.5
    scores = scores.masked_fill(inputs["attention_mask"][:, None, None, :] == 0, float("-inf"))
    on_token = scores.softmax(-1).mean(1)[torch.arange(3), :, positions]  # (N, cells)
    torch.testing.assert_close(result.maps[:, 0].flatten(1), on_token / on_token.sum(-1, keepdim=True))
    with torch.no_grad():
        torch.testing.assert_close(result.logits, model(**inputs).logits)
    assert model.mm_fusion.vision_encoder.vision_text_attention.recorded is None  # the model is left as it was


def test_wrong_requests_are_named(tester):
    late = classifier(tester, "late", "resnet")
    inputs = tester.inputs()
    with pytest.raises(ValueError, match="late-fusion model has no cross-attention"):
        late.image_maps(**inputs, method="attention")
    with pytest.raises(ValueError, match="Unknown map method 'saliency'"):
        late.image_maps(**inputs, method="saliency")
    fused = classifier(tester, "hierarchical", "resnet")
    with pytest.raises(ValueError, match="`targets` choose the answer a gradient map explains; a 'attention' map"):
        fused.image_maps(**inputs, method="attention", targets=torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="a 'guided_gradient' map has no tokens"):
        fused.image_maps(**inputs, token=1)
    with pytest.raises(ValueError, match="outside the texts' 7 positions"):
        fused.image_maps(**inputs, method="attention", token=7)
    with pytest.raises(ValueError, match="outside the texts' 7 positions"):
        fused.image_maps(**inputs, method="attention", token=torch.tensor([0, -1, 2]))
    with pytest.raises(ValueError, match=r"one position or one per pair \(3\), got \[2\]"):
        fused.image_maps(**inputs, method="attention", token=torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="this model's vision tower reads no text"):
        fused.image_maps(**inputs, method="tower_attention", token=1)
    reading = classifier(tester, "hierarchical", "resnet", vision_text_attention=True)
    with pytest.raises(ValueError, match="method='tower_attention' needs `token`"):
        reading.image_maps(**inputs, method="tower_attention")


def test_peak_on_reads_the_mask_at_the_peak():
    maps = torch.zeros(3, 4, 4)
    maps[0, 1, 2] = 1.0  # 4 x 4 cells on 64 px: the centre (23.5, 39.5) falls in pixel (24, 40)
    maps[1, 0, 0] = 1.0  # centre (7.5, 7.5): pixel (8, 8)
    pixels = torch.zeros(3, 64, 64)
    pixels[2, 63, 0] = 1.0  # a map on the pixels: its peak is that pixel
    masks = torch.zeros(3, 64, 64, dtype=torch.bool)
    masks[0, 24, 40] = masks[1, 7, 7] = masks[2, 63, 0] = True
    assert peak_on(maps[:2], masks[:2]).tolist() == [True, False]
    assert peak_on(pixels, masks).tolist() == [False, False, True]


def test_peak_inside_takes_the_centre_of_the_highest_cell():
    maps = torch.zeros(4, 4, 4)
    maps[0, 1, 2] = 1.0  # a 4x4 grid on 64 px: cell (row 1, column 2) covers x 32-47, y 16-31; its centre (39.5, 23.5)
    maps[1, 3, 0] = 1.0  # centre (7.5, 55.5)
    maps[2] = 1.0 / 16  # flat: the first cell, centre (7.5, 7.5)
    maps[3, 0, 3] = 1.0  # a corner cell: its centre (55.5, 7.5), not the image's edge
    boxes = torch.tensor([[35, 20, 44, 29], [35, 20, 44, 29], [0, 0, 7, 7], [50, 2, 59, 11]])
    assert peak_inside(maps, boxes, (64, 64)).tolist() == [True, False, True, True]
    assert not peak_inside(maps[:1], torch.tensor([[41, 24, 50, 33]]), (64, 64)).item()  # the centre just outside
    assert upsample(maps, (64, 64)).shape == (4, 64, 64)
    # Whether a grid can point inside a box at all: 4 x 4 cells on 64 px are centred at 7.5, 23.5, 39.5 and 55.5.
    small = torch.tensor([[9, 9, 18, 18], [20, 20, 29, 29], [9, 40, 18, 49]])  # none; (23.5, 23.5); y only
    assert reachable((4, 4), small, (64, 64)).tolist() == [False, True, False]
    assert reachable((8, 8), small, (64, 64)).all()  # 8-px cells: a 10-px box always holds a centre
    # Per layer: (N, L, h, w) maps give (N, L).
    assert peak_inside(torch.stack([maps, maps.flip(0)], 1), boxes, (64, 64)).shape == (4, 2)


class RegionReader(torch.nn.Module):
    """Answers 1 when the 8 x 8 square at the top left is mostly red, else 0 (its logits)."""

    def forward(self, pixel_values, **kwargs):
        red = pixel_values[:, 0, :8, :8].float().mean((-1, -2)) / 255
        return type("Output", (), {"logits": torch.stack([0.5 - red, red - 0.5], -1)})()


def test_deletion_test_paints_the_median_colour_at_the_peak_and_elsewhere():
    images = torch.zeros(4, 3, 40, 40, dtype=torch.uint8)
    images[:, 0, :8, :8] = 255  # the evidence: a red square at the top left, on black
    maps = torch.zeros(4, 40, 40)
    maps[:2, 3, 3] = 1.0  # peaks on the square
    maps[2:, 30, 30] = 1.0  # peaks away from it
    inputs = {"pixel_values": images, "input_ids": torch.ones(4, 3, dtype=torch.long)}
    at_peak, at_random = deletion_test(
        RegionReader(), inputs, maps, side=10, generator=torch.Generator().manual_seed(0)
    )
    assert at_peak.tolist() == [True, True, False, False]
    # A random square away from the peak's: for the last two it may land on the evidence; for the first two it cannot
    # overlap the peak's square, which covers the evidence.
    assert at_random[:2].tolist() == [False, False]
    painted = paint(images, torch.tensor([3]), torch.tensor([3]), 10)[0]
    assert painted[:, :10, :10].eq(0).all() and torch.equal(painted[:, 10:], images[0, :, 10:])  # moved inside
    assert torch.equal(foreground_masks(images)[0], images[0, 0] > 0)
    with pytest.raises(ValueError, match="no room for two 30 x 30 squares"):
        deletion_test(RegionReader(), inputs, maps, side=30)
