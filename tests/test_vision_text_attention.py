"""A backbone / convolutional vision tower conditioned on the text by cross-attention
(`MMFusionConfig.vision_text_attention`): each cell of every stage after the stem reads the text's tokens."""

import copy

import pytest
import torch
from test_vision_film import check_each_image_conditioned_on_its_own_text, check_refuses_an_image_without_its_text

from mm_fusion import MMFusionConfig, MMFusionForImageTextClassification, MMFusionModel
from mm_fusion.training.model_card import describe_vision_tower
from mm_fusion.vision_towers import MMFusionStageRead, film_stages


def text_attention_config(tester, tower: str = "resnet", fusion_type: str = "hierarchical", **kwargs):
    vision = tester.resnet_config() if tower == "resnet" else tester.mobilenet_config()
    return tester.config(fusion_type, vision_config=vision, **{"vision_text_attention": True, **kwargs})


def test_every_stage_after_the_stem_reads_the_text(tester):
    resnet = MMFusionModel(text_attention_config(tester))
    reads = resnet.vision_encoder.vision_text_attention.reads
    # ResNet: stem, stage1 (8 channels), stage2 (16): each stage's cells ask with queries from their own channels.
    assert [read.query.in_features for read in reads] == [8, 16]
    assert [read.output.out_features for read in reads] == [8, 16]
    assert {read.key.in_features for read in reads} == {resnet.config.text_config.hidden_size}
    assert film_stages(resnet.vision_model, resnet.config.vision_config) is resnet.vision_model.encoder.stages
    mobilenet = MMFusionModel(text_attention_config(tester, "mobilenet", "late"))
    assert len(mobilenet.vision_encoder.vision_text_attention.reads) == 16  # every hidden_states map of MobileNetV2


def test_each_cell_reads_for_itself_and_never_the_padding():
    """One head, hand-set weights: a cell whose channels point at a token's key reads that token's value, so two
    cells of one map read two different words; a padding token is never read, whatever it holds."""
    torch.manual_seed(0)
    read = MMFusionStageRead(channels=2, text_width=2, num_heads=1).eval()
    with torch.no_grad():
        read.norm.weight.fill_(1.0), read.norm.bias.zero_()
        for layer in (read.query, read.key, read.value, read.output):
            layer.weight.copy_(torch.eye(2) * (20.0 if layer is read.query else 1.0))
            layer.bias.zero_()
    hidden = torch.zeros(1, 2, 1, 2)  # two cells: the first's channels (1, -1), the second's (-1, 1)
    hidden[0, :, 0, 0] = torch.tensor([1.0, -1.0])
    hidden[0, :, 0, 1] = torch.tensor([-1.0, 1.0])
    text = torch.tensor([[[1.0, -1.0], [-1.0, 1.0], [50.0, 50.0]]])  # two words, then padding
    mask = torch.tensor([[True, True, False]])[:, None, None, :]
    with torch.no_grad():
        out = read(hidden, text, mask)
        read_values = (out - hidden)[0, :, 0, :].T  # (cells, channels)
        torch.testing.assert_close(read_values, torch.tensor([[1.0, -1.0], [-1.0, 1.0]]), atol=1e-3, rtol=0)
        text[0, 2] = torch.tensor([1e3, -1e3])  # padding that the first cell would read, were it not masked
        torch.testing.assert_close(read(hidden, text, mask), out)
        assert read(hidden, text, None)[0, 0, 0, 0] > 100


def test_text_attention_conditions_each_image_on_its_own_text(tester):
    model = MMFusionForImageTextClassification(text_attention_config(tester, fusion_type="cross_attention")).eval()
    check_each_image_conditioned_on_its_own_text(model, tester.inputs())  # 3 texts, 3 images


def test_text_attention_trains_saves_and_reloads(tester, tmp_path):
    config = text_attention_config(tester, "mobilenet", "hierarchical", vision_bridge_layers=[5, 15])
    model = MMFusionForImageTextClassification(config).train()
    inputs = tester.inputs()
    model(**inputs, labels=torch.tensor([0, 1, 2])).loss.backward()
    grads = [read.query.weight.grad for read in model.mm_fusion.vision_encoder.vision_text_attention.reads]
    assert all(g is not None for g in grads) and sum(float(g.abs().sum()) for g in grads) > 0
    model.eval()
    copied = copy.deepcopy(model)  # its hooks read through its own modules, not the original's
    with torch.no_grad():
        expected = model(**inputs).logits
        torch.testing.assert_close(copied(**inputs).logits, expected)
        for p in model.mm_fusion.vision_encoder.vision_text_attention.parameters():
            p.add_(1.0)
        torch.testing.assert_close(copied(**inputs).logits, expected)
        assert not torch.allclose(model(**inputs).logits, expected, atol=1e-4)
    model.save_pretrained(tmp_path)
    reloaded = MMFusionForImageTextClassification.from_pretrained(tmp_path).eval()
    assert reloaded.config.vision_text_attention is True and reloaded.config.vision_film is False
    assert "every stage's cells read the text by cross-attention" in describe_vision_tower(reloaded.config, 30)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**inputs).logits, model(**inputs).logits)


def test_text_attention_refuses_what_it_cannot_serve(tester):
    with pytest.raises(ValueError, match="vision_text_attention conditions .* the ViTConfig tower is a transformer"):
        tester.config(vision_text_attention=True)
    with pytest.raises(ValueError, match="vision_film and vision_text_attention both condition .* choose one"):
        text_attention_config(tester, vision_film=True)
    config = text_attention_config(tester)
    check_refuses_an_image_without_its_text(config, tester.inputs())
    assert isinstance(MMFusionConfig.from_dict(config.to_dict()).vision_text_attention, bool)


def test_a_run_with_tower_reads_draws_them(tmp_path):
    """A run with `vision_text_attention`: scripts/visualize_attention.py draws the cells' attention to a token
    (`--method tower_attention --token N`), one panel per stage read, and says which answer it explains; without
    `--token` it stops before loading the model."""
    from pathlib import Path

    from helpers.run_scripts import run_in_one_child
    from helpers.training import TINY
    from PIL import Image

    from mm_fusion.data import load_easy_vqa
    from mm_fusion.training import setup_run, train_and_save

    out = tmp_path / "run"
    flags = ["--vision_tower", "resnet", "--vision_widths", "8,16", "--max_steps", "2", "--max_eval_samples", "8"]
    flags += ["--config_overrides", "vision_text_attention=true"]
    train_and_save(setup_run(["--output_dir", str(out), *TINY, *flags]))
    row = load_easy_vqa(["test"])["test"][0]
    script = str(Path(__file__).resolve().parents[1] / "scripts" / "visualize_attention.py")
    png = tmp_path / "reads.png"
    args = ["--model", str(out), "--image", row["image"], "--question", row["question"], "--output", str(png)]
    # both command lines in one child interpreter (tests/helpers/run_scripts.py), each as `python SCRIPT` runs it
    done, refused = run_in_one_child(
        [{"argv": [script, *args, "--method", "tower_attention", "--token", "1"]},
         {"argv": [script, *args, "--method", "tower_attention"], "no_model": True}],
        tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert Image.open(png).size[0] > 300
    model = MMFusionForImageTextClassification.from_pretrained(out).eval()
    from transformers import AutoProcessor

    batch = AutoProcessor.from_pretrained(out)(images=[row["image"]], text=[row["question"]])
    result = model.image_maps(**batch, method="tower_attention", token=1)
    assert result.layers == ["vision stage 1 read", "vision stage 2 read"]  # the stem, then two stages that read
    answer = model.config.id2label[int(result.targets[0])]
    assert done.stderr.splitlines()[-1].startswith(f"{answer} (") and "the tower's reads" in done.stderr
    assert refused.returncode == 2 and "--method tower_attention maps the attention the cells give one token" in (
        refused.stderr
    )


def test_train_py_gives_a_conv_tower_with_cross_attention_its_reads():
    """scripts/train.py's model from scratch: a ResNet / ConvNeXt tower with cross-attention fusion and a
    classification head gets the stages' reads, the PyTorch draw and no feature-map bridge (what Sort-of-CLEVR's
    position questions need); `--config_overrides` wins; nothing changes for the ViT, late fusion, pretraining,
    pretrained towers or a FiLM tower; `MMFusionConfig`'s own defaults stay as saved models were made with."""
    from mm_fusion.training import ModelArguments, build_config

    def config(**kwargs):
        return build_config(ModelArguments(**kwargs), 64, 50, 16, ["yes", "no"])

    def chosen(cfg):
        return cfg.vision_text_attention, cfg.init_scheme, cfg.feature_map_bridge

    earlier = (False, "normal", True)
    assert chosen(MMFusionConfig()) == earlier
    assert chosen(config()) == (True, "pytorch", False)  # the default: ResNet, hierarchical, vqa
    assert chosen(config(vision_tower="convnext", fusion_type="cross_attention", task="classify")) == (
        True,
        "pytorch",
        False,
    )
    assert chosen(config(config_overrides="init_scheme=normal")) == (True, "normal", False)
    assert chosen(config(config_overrides="fusion_init=normal")) == (True, "normal", False)  # the earlier name
    assert chosen(config(config_overrides="vision_text_attention=false")) == (False, "pytorch", False)
    film = config(config_overrides="vision_film=true")
    assert film.vision_film and chosen(film) == (False, "pytorch", False)
    for kwargs in (dict(vision_tower="vit"), dict(fusion_type="late"), dict(task="pretrain")):
        assert chosen(config(**kwargs)) == earlier, kwargs
    pretrained = ModelArguments(text_model_name_or_path="some/bert")  # read by build_model, not here
    assert chosen(build_config(pretrained, 64, 50, 16, ["yes", "no"])) == earlier


@pytest.mark.parametrize("tower,conditioning", [("resnet", "text_attention"), ("mobilenet", "film")])
def test_stem_runs_once_per_image_when_texts_share_images(tester, tower, conditioning):
    """Three texts about two images: the stem and the first stage (which see no text) run on the two images, the
    stages after them on the three texts; outputs, every hidden state and the gradients equal those of the tower run
    once per text on a copy of its image."""
    vision = tester.resnet_config() if tower == "resnet" else tester.mobilenet_config()
    key = "vision_text_attention" if conditioning == "text_attention" else "vision_film"
    model = MMFusionForImageTextClassification(tester.config("hierarchical", vision_config=vision, **{key: True}))
    model.eval()  # BatchNorm from running statistics: a batch of two images normalises as one of three would
    for p in model.mm_fusion.parameters():  # FiLM maps start at zero: make every conditioning count
        p.data.add_(0.05 * torch.randn_like(p))
    inputs = tester.inputs()
    index = torch.tensor([1, 1, 0])
    shared_inputs = {**inputs, "pixel_values": inputs["pixel_values"][:2], "image_index": index}
    paired_inputs = {**inputs, "pixel_values": inputs["pixel_values"][index]}
    stem = next(m for m in model.mm_fusion.vision_model.modules() if isinstance(m, torch.nn.Conv2d))
    rows = []
    handle = stem.register_forward_hook(lambda module, args, output: rows.append(len(output)))
    labels = torch.tensor([0, 1, 2])
    shared = model(**shared_inputs, labels=labels, output_hidden_states=True)
    shared.loss.backward()
    shared_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    paired = model(**paired_inputs, labels=labels, output_hidden_states=True)
    paired.loss.backward()
    handle.remove()
    assert rows == [2, 3]  # the stem's first convolution: once per image, then (unshared) once per text
    torch.testing.assert_close(shared.logits, paired.logits)
    assert [h.shape for h in shared.vision_hidden_states] == [h.shape for h in paired.vision_hidden_states]
    for a, b in zip(shared.vision_hidden_states, paired.vision_hidden_states):
        torch.testing.assert_close(a, b)
    assert shared_grads.keys() == {n for n, p in model.named_parameters() if p.grad is not None}
    for name, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(shared_grads[name], p.grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("factored", [True, False])
@pytest.mark.parametrize("tokens", [5, 40])
def test_stage_read_equals_attention_written_out(tokens, factored):
    """Both ways a stage's read is computed (factored through the text's side, or projected per cell through SDPA)
    equal softmax(q k^T / sqrt(d)) v over the unmasked tokens, written out here, and `probabilities` is that
    softmax."""
    torch.manual_seed(0)
    read = MMFusionStageRead(channels=6, text_width=8, num_heads=2)
    for p in read.parameters():
        p.data.normal_()
    read._factored_pays = lambda cells, channels, tokens: factored
    hidden = torch.randn(3, 6, 4, 5).contiguous(memory_format=torch.channels_last)
    text = torch.randn(3, tokens, 8)
    keep = torch.ones(3, tokens, dtype=torch.bool)
    keep[1, tokens // 2 :] = False
    mask = keep[:, None, None, :]
    with torch.no_grad():
        cells = read.norm(hidden.flatten(2).transpose(1, 2))
        q, k, v = (layer(x).unflatten(-1, (2, 4)).transpose(1, 2) for layer, x in
                   ((read.query, cells), (read.key, text), (read.value, text)))  # fmt: skip
        scores = (q @ k.transpose(-1, -2) / 2.0).masked_fill(~mask, float("-inf"))
        probabilities = scores.softmax(-1)  # (batch, heads, cells, tokens)
        read_out = read.output((probabilities @ v).transpose(1, 2).flatten(2))  # (batch, cells, channels)
        expected = hidden + read_out.transpose(1, 2).reshape(3, 6, 4, 5)
        torch.testing.assert_close(read(hidden, text, mask), expected, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(read.probabilities(hidden, text, mask), probabilities, atol=1e-5, rtol=1e-4)
    assert float(probabilities[1, :, :, tokens // 2 :].abs().max()) == 0.0


def test_a_long_read_is_factored_and_a_coarse_one_projected():
    """The first stage's read of a question (16 x 16 cells, 24 channels, 12 tokens) is factored; the last stage's (4 x
    4 cells, 96 channels) and a read of 64 tokens are projected (the crossings measured in profile_training_step)."""
    read = MMFusionStageRead(channels=24, text_width=96, num_heads=4)
    assert read._factored_pays(256, 24, 12)
    assert not read._factored_pays(256, 24, 64)
    assert not MMFusionStageRead(channels=96, text_width=96, num_heads=4)._factored_pays(16, 96, 12)


def test_reads_may_start_at_a_later_stage(tester, tmp_path):
    """`vision_text_attention_from_stage=2`: the first stage reads nothing and, with texts sharing images, runs once
    per image like the stem; outputs and gradients equal those of the tower run once per text; saved and reloaded
    with it; a stage the tower does not have is refused, naming the setting."""
    config = text_attention_config(tester, vision_text_attention_from_stage=2)
    model = MMFusionForImageTextClassification(config)
    reads = model.mm_fusion.vision_encoder.vision_text_attention.reads
    assert [read.query.in_features for read in reads] == [16]  # the tiny ResNet's second stage only
    model.eval()
    inputs = tester.inputs()
    index = torch.tensor([1, 1, 0])
    stages = model.mm_fusion.vision_model.encoder.stages
    rows = []
    handles = [stage.register_forward_pre_hook(lambda m, args: rows.append(len(args[0]))) for stage in stages]
    labels = torch.tensor([0, 1, 2])
    shared_inputs = {**inputs, "pixel_values": inputs["pixel_values"][:2], "image_index": index}
    shared = model(**shared_inputs, labels=labels)
    shared.loss.backward()
    shared_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    paired = model(**{**inputs, "pixel_values": inputs["pixel_values"][index]}, labels=labels)
    paired.loss.backward()
    for handle in handles:
        handle.remove()
    # The rows each stage runs on: stage 1 and stage 2 on the two images when shared (stage 2's read then expands its
    # output to the three texts), both on the three texts when not.
    assert rows == [2, 2, 3, 3]
    torch.testing.assert_close(shared.logits, paired.logits)
    for name, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(shared_grads[name], p.grad, atol=1e-5, rtol=1e-4, msg=name)
    model.save_pretrained(tmp_path)
    reloaded = MMFusionForImageTextClassification.from_pretrained(tmp_path).eval()
    assert reloaded.config.vision_text_attention_from_stage == 2
    torch.testing.assert_close(reloaded(**shared_inputs).logits, model(**shared_inputs).logits)
    with pytest.raises(ValueError, match="vision_text_attention_from_stage=3"):
        text_attention_config(tester, vision_text_attention_from_stage=3)
    with pytest.raises(ValueError, match="vision_text_attention_from_stage=0"):
        text_attention_config(tester, vision_text_attention_from_stage=0)
