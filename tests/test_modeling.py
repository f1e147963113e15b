"""MMFusion models: shapes, training signal, invariances, save/load, gradient checkpointing, transformers' model API
(hidden states, attentions, eager / SDPA, tuples, embeddings), clear errors."""

import copy
import dataclasses
import inspect
import json
import os
import re

import pytest
import torch
from helpers.models import FUSION_TYPES, expected_output_shapes
from huggingface_hub.errors import StrictDataclassFieldValidationError
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForPreTraining,
    AutoModelForVisualQuestionAnswering,
    BertConfig,
    CLIPConfig,
    CLIPVisionConfig,
    PreTrainedConfig,
)

from mm_fusion import (
    MMFusionConfig,
    MMFusionForImageTextClassification,
    MMFusionForPretraining,
    MMFusionModel,
)


HEADS = [MMFusionModel, MMFusionForImageTextClassification, MMFusionForPretraining]
BASE_CONFIG_FIELDS = {f.name for f in dataclasses.fields(PreTrainedConfig)}


def _outputs(model, inputs):
    """The tensors of a model's output that should be deterministic functions of one sample."""
    with torch.no_grad():
        out = model(**inputs)
    if isinstance(model, MMFusionModel):
        return {"pooler_output": out.pooler_output, "text_pooled": out.text_pooled, "image_pooled": out.image_pooled}
    if isinstance(model, MMFusionForImageTextClassification):
        return {"logits": out.logits}
    return {"image_embeds": out.image_embeds, "text_embeds": out.text_embeds, "itm_logits": out.itm_logits}


def _assert_close(a: dict, b: dict, atol: float = 1e-5):
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=atol, rtol=1e-4, msg=lambda m, k=key: f"{k}: {m}")


@pytest.mark.parametrize("fusion_type", FUSION_TYPES)
def test_output_shapes(tester, fusion_type):
    config = tester.config(fusion_type)
    B, T = tester.batch_size, tester.seq_length
    inputs = tester.inputs()

    base = MMFusionModel(config).eval()
    out = base(**inputs)
    D = config.fusion_hidden_size if fusion_type != "late" else 32  # towers are 32 wide
    num_patches = (tester.image_size // 2) ** 2 + 1  # + CLS
    assert out.text_hidden_state.shape == (B, T, D)
    assert out.image_hidden_state.shape == (B, num_patches, D)
    pooled = 3 * config.projection_dim if fusion_type == "late" else 2 * config.fusion_hidden_size
    assert out.pooler_output.shape == (B, pooled) and base.pooled_dim == pooled
    if fusion_type != "late":  # the product joins the two pooled vectors
        config.joint_pooling = "concat_product"
        product = MMFusionModel(config).eval()(**inputs)
        assert product.pooler_output.shape == (B, 3 * D)
        text, image = product.text_pooled, product.image_pooled
        torch.testing.assert_close(product.pooler_output, torch.cat([text, image, text * image], dim=-1))
        config.joint_pooling = "text"  # the text stream alone, after it read the image
        text_only = MMFusionModel(config).eval()(**inputs)
        assert text_only.pooler_output.shape == (B, D)
        torch.testing.assert_close(text_only.pooler_output, text_only.text_pooled)
    image_features = base.get_image_features(inputs["pixel_values"])
    assert image_features.pooler_output.shape == (B, config.projection_dim)
    assert image_features.last_hidden_state.shape == (B, num_patches, 32)
    text_features = base.get_text_features(inputs["input_ids"], inputs["attention_mask"])
    assert text_features.pooler_output.shape == (B, config.projection_dim)
    assert text_features.last_hidden_state.shape == (B, T, 32)

    clf = MMFusionForImageTextClassification(config).eval()
    assert clf(**inputs).logits.shape == (B, tester.num_labels)

    pre = MMFusionForPretraining(config).eval()
    out = pre(**inputs, return_loss=True)
    assert out.logits_per_image.shape == (B, B) and out.logits_per_text.shape == (B, B)
    assert out.itm_logits.shape == (B, 2)
    assert out.image_embeds.shape == (B, config.projection_dim)
    torch.testing.assert_close(out.image_embeds.norm(dim=-1), torch.ones(B))
    assert torch.isfinite(out.loss) and torch.isclose(out.loss, out.itc_loss + out.itm_loss)


@pytest.mark.parametrize("fusion_type", FUSION_TYPES)
@pytest.mark.parametrize("head", ["classification", "soft_scores", "pretraining"])
def test_loss_decreases_when_overfitting_one_batch(tester, fusion_type, head):
    torch.manual_seed(0)
    config = tester.config(fusion_type)
    inputs = tester.inputs(batch_size=4)
    if head == "pretraining":
        model = MMFusionForPretraining(config)
        inputs["return_loss"] = True
    else:
        model = MMFusionForImageTextClassification(config)
        labels = torch.tensor([0, 3, 1, 4])
        inputs["labels"] = labels if head == "classification" else torch.eye(tester.num_labels)[labels] * 0.9
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(25):
        loss = model(**inputs).loss
        assert torch.isfinite(loss)
        losses.append(loss.item())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize("fusion_type", FUSION_TYPES)
@pytest.mark.parametrize("head", HEADS)
def test_padding_invariance(tester, fusion_type, head):
    """Extra pad tokens after a text change none of its outputs."""
    model = head(tester.config(fusion_type)).eval()
    inputs = tester.inputs()
    padded = dict(inputs)
    extra = 5
    padded["input_ids"] = torch.cat([inputs["input_ids"], torch.zeros(tester.batch_size, extra, dtype=torch.long)], 1)
    padded["attention_mask"] = torch.cat(
        [inputs["attention_mask"], torch.zeros(tester.batch_size, extra, dtype=torch.long)], 1
    )
    _assert_close(_outputs(model, inputs), _outputs(model, padded))


@pytest.mark.parametrize("fusion_type", FUSION_TYPES)
@pytest.mark.parametrize("head", HEADS)
def test_batch_invariance(tester, fusion_type, head):
    """In eval mode a sample's outputs do not depend on the other samples in its batch."""
    model = head(tester.config(fusion_type)).eval()
    inputs = tester.inputs(batch_size=4)
    batched = _outputs(model, inputs)
    for i in range(4):
        single = {k: v[i : i + 1] for k, v in inputs.items()}
        # Trim the single sample's padding too: its outputs must not depend on the batch's padded length either.
        length = int(single["attention_mask"].sum())
        single["input_ids"], single["attention_mask"] = (
            single["input_ids"][:, :length],
            single["attention_mask"][:, :length],
        )
        alone = _outputs(model, single)
        if head is MMFusionForPretraining:
            alone.pop("itm_logits"), batched.pop("itm_logits", None)  # matching scores of the pair itself, below
        _assert_close({k: v[i : i + 1] for k, v in batched.items()}, alone)
    if head is MMFusionForPretraining:
        # The positive-pair matching score is a function of the pair only.
        with torch.no_grad():
            itm = model(**inputs).itm_logits
            itm_alone = model(**{k: v[1:2] for k, v in inputs.items()}).itm_logits
        torch.testing.assert_close(itm[1:2], itm_alone, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("direction", ["bidirectional", "text_to_image"])
@pytest.mark.parametrize("fusion_type", FUSION_TYPES)
def test_shared_images_match_repeated_images(tester, fusion_type, direction):
    """`image_index` lets questions share one encoded image; results equal passing the image once per question."""
    model = MMFusionForImageTextClassification(tester.config(fusion_type, fusion_direction=direction)).eval()
    inputs = tester.inputs(batch_size=4)
    images = inputs["pixel_values"][:2]
    image_index = torch.tensor([0, 1, 1, 0])
    with torch.no_grad():
        shared = model(**{**inputs, "pixel_values": images}, image_index=image_index).logits
        repeated = model(**{**inputs, "pixel_values": images[image_index]}).logits
    torch.testing.assert_close(shared, repeated, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("fusion_type", FUSION_TYPES)
def test_repeated_texts_are_encoded_once_with_each_texts_own_outputs(tester, fusion_type):
    """A text tower in eval mode (evaluation, serving, a frozen tower in training) runs on the distinct texts of a
    batch only; every output, the tower's hidden states and attentions too, equals each pair's own pass."""
    model = _eager_copy(MMFusionForImageTextClassification(_small_config(tester, fusion_type)).eval())
    inputs = tester.inputs(batch_size=4)
    order = torch.tensor([2, 0, 2, 2])
    inputs |= {"input_ids": inputs["input_ids"][order], "attention_mask": inputs["attention_mask"][order]}
    texts = []
    model.mm_fusion.text_model.register_forward_hook(
        lambda module, args, kwargs, output: texts.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    with torch.no_grad():
        together = _float_tensors(model(**inputs, output_hidden_states=True, output_attentions=True))
        alone = [
            _float_tensors(model(**{k: v[i : i + 1] for k, v in inputs.items()}, output_hidden_states=True,
                                 output_attentions=True))
            for i in range(4)
        ]  # fmt: skip
    assert texts == [2, 1, 1, 1, 1]
    assert together.keys() == alone[0].keys() and {"text_hidden_states.1", "text_attentions.1"} <= together.keys()
    for i in range(4):
        _assert_close({name: value[i : i + 1] for name, value in together.items()}, alone[i])


def _frozen_text_model(tester, fusion_type: str, **kwargs):
    """A classifier whose text tower is frozen (as `scripts/train.py` freezes a pretrained one), in training mode, with
    a hook that records how many texts each call of the text tower encodes."""
    model = MMFusionForImageTextClassification(_small_config(tester, fusion_type, **kwargs))
    model.mm_fusion.text_model.requires_grad_(False)
    model.train()
    calls = []
    model.mm_fusion.text_model.register_forward_hook(
        lambda module, args, kwargs, output: calls.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    return model, calls


@pytest.mark.parametrize(
    "fusion_type, bridges",
    [*((t, None) for t in FUSION_TYPES), ("hierarchical", ["words", 2]), ("hierarchical", ["words", "words"])],
)
def test_frozen_text_tower_encodes_each_text_once_across_batches(tester, fusion_type, bridges):
    """A frozen text tower keeps what it gave each text: a later batch runs it on its new texts only, and every batch's
    logits and gradients equal those of the tower run on the whole batch (hierarchical fusion reading the tower's
    layers, its word embeddings, or both)."""
    config_kwargs = {"text_bridge_layers": bridges} if bridges else {}
    model, calls = _frozen_text_model(tester, fusion_type, **config_kwargs)
    assert not model.mm_fusion.text_model.training  # a frozen tower stays in eval mode: no dropout
    uncached = copy.deepcopy(model)
    uncached.mm_fusion.text_cache.enabled = False
    inputs = tester.inputs(batch_size=4)
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    labels = torch.tensor([0, 1, 0, 1])
    for order, encoded in (([2, 0, 2, 2], [2]), ([0, 2, 0, 0], []), ([1, 2, 3, 1], [2])):
        calls.clear()
        batch = {**inputs, "input_ids": ids[order], "attention_mask": mask[order], "labels": labels}
        torch.manual_seed(0)
        cached_out = model(**batch)
        assert calls == encoded, order
        torch.manual_seed(0)
        plain_out = uncached(**batch)
        torch.testing.assert_close(cached_out.logits, plain_out.logits, atol=1e-5, rtol=1e-4)
        cached_out.loss.backward()
        plain_out.loss.backward()
        for (name, a), b in zip(model.named_parameters(), uncached.parameters()):
            if a.requires_grad:
                torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
    assert model.mm_fusion.text_cache.found == 3 and model.mm_fusion.text_cache.looked_up == 7


def test_frozen_text_cache_follows_the_towers_weights_and_steps_aside(tester):
    """New weights (loaded in place) empty the cache; a trainable tower, attentions or hidden states asked for, and
    texts that seldom repeat run the tower itself."""
    model, calls = _frozen_text_model(tester, "hierarchical")
    model.eval()
    inputs = tester.inputs(batch_size=2)
    text_model = model.mm_fusion.text_model
    with torch.no_grad():
        before = model(**inputs).logits
        changed = {
            name: value + 0.05 * torch.randn_like(value) if value.is_floating_point() else value
            for name, value in text_model.state_dict().items()
        }
        text_model.load_state_dict(changed)
        after = model(**inputs).logits
        model.mm_fusion.text_cache.enabled = False
        expected = model(**inputs).logits
        model.mm_fusion.text_cache.enabled = True
    assert calls == [2, 2, 2] and not torch.allclose(before, after)
    torch.testing.assert_close(after, expected)

    calls.clear()
    with torch.no_grad():
        model(**inputs)  # kept
        model(**inputs, output_attentions=True)
        model(**inputs, output_hidden_states=True)
        text_model.requires_grad_(True)
        model(**inputs)
    assert calls == [2, 2, 2]

    text_model.requires_grad_(False)
    cache = model.mm_fusion.text_cache = type(model.mm_fusion.text_cache)(probe=8)
    calls.clear()
    with torch.no_grad():
        for _ in range(4):  # every text new: after 8 texts looked up, none found, the cache turns itself off
            fresh = {**inputs, "input_ids": torch.randint(5, tester.vocab_size, inputs["input_ids"].shape)}
            model(**fresh)
        assert not cache.enabled and not cache.entries
        model(**fresh)
    assert calls == [2, 2, 2, 2, 2]


def test_text_to_image_fusion_has_no_image_stream_and_trains(tester):
    config = tester.config("hierarchical", fusion_direction="text_to_image")
    model = MMFusionForPretraining(config)
    assert all(layer.image_block is None for layer in model.mm_fusion.encoder.layers)
    inputs = tester.inputs(batch_size=4)
    out = model(**inputs, return_loss=True)
    out.loss.backward()
    assert out.itm_logits.shape == (4, 2)
    assert model.mm_fusion.encoder.layers[0].text_block.cross_attn.k_proj.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="fusion_direction"):
        tester.config(fusion_direction="image_to_text")


@pytest.mark.parametrize("fusion_type", FUSION_TYPES)
@pytest.mark.parametrize(
    "head, auto_class",
    [
        (MMFusionModel, AutoModel),
        (MMFusionForImageTextClassification, AutoModelForVisualQuestionAnswering),
        (MMFusionForPretraining, AutoModelForPreTraining),
    ],
)
def test_save_load_equality(tester, tmp_path, fusion_type, head, auto_class):
    model = head(tester.config(fusion_type)).eval()
    model.save_pretrained(tmp_path)
    files = os.listdir(tmp_path)
    assert "model.safetensors" in files
    assert not [f for f in files if f.endswith((".bin", ".pt", ".pth", ".pkl"))], files
    # The code travels with the weights, for trust_remote_code loading.
    assert {"configuration_mm_fusion.py", "modeling_mm_fusion.py"} <= set(files)
    # Whichever head was saved, every Auto class can load the directory with trust_remote_code.
    auto_map = json.loads((tmp_path / "config.json").read_text())["auto_map"]
    assert auto_map == {
        "AutoConfig": "configuration_mm_fusion.MMFusionConfig",
        "AutoModel": "modeling_mm_fusion.MMFusionModel",
        "AutoModelForPreTraining": "modeling_mm_fusion.MMFusionForPretraining",
        "AutoModelForVisualQuestionAnswering": "modeling_mm_fusion.MMFusionForImageTextClassification",
        "AutoModelForZeroShotImageClassification": "modeling_mm_fusion.MMFusionForPretraining",
    }

    reloaded = auto_class.from_pretrained(tmp_path).eval()
    assert type(reloaded) is head
    before = model.state_dict()
    after = reloaded.state_dict()
    assert before.keys() == after.keys()
    for key in before:
        assert torch.equal(before[key], after[key]), key
    inputs = tester.inputs()
    _assert_close(_outputs(model, inputs), _outputs(reloaded, inputs), atol=0)


@pytest.mark.parametrize("fusion_type", FUSION_TYPES)
@pytest.mark.parametrize("head", [MMFusionForImageTextClassification, MMFusionForPretraining])
def test_gradient_checkpointing_gives_same_gradients(tester, fusion_type, head):
    config = tester.config(fusion_type)  # dropout stays on: checkpointing must replay the same masks
    torch.manual_seed(0)
    model = head(config).train()
    inputs = tester.inputs(batch_size=4)
    if head is MMFusionForImageTextClassification:
        inputs["labels"] = torch.tensor([0, 1, 2, 3])
    else:
        inputs["return_loss"] = True

    def grads():
        model.zero_grad()
        torch.manual_seed(1)
        model(**inputs).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    reference = grads()
    calls = []
    # A checkpointed layer's children run again in backward (the layer's own forward hooks fire once).
    layer = model.mm_fusion.encoder.layers[0] if fusion_type != "late" else model.mm_fusion.text_model.encoder.layer[0]
    hook = next(layer.children()).register_forward_hook(lambda *_: calls.append(1))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    checkpointed = grads()
    hook.remove()
    assert len(calls) == 2, "the layer should run again in backward when checkpointed"
    assert reference.keys() == checkpointed.keys()
    for name in reference:
        torch.testing.assert_close(reference[name], checkpointed[name], atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("fusion_type", FUSION_TYPES)
def test_config_round_trip_through_auto_config(tester, tmp_path, fusion_type):
    config = tester.config(fusion_type, fusion_dropout=0.2, pooling_mode="cls")
    config.save_pretrained(tmp_path)
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert type(loaded) is MMFusionConfig
    assert type(loaded.vision_config) is type(config.vision_config)
    assert type(loaded.text_config) is type(config.text_config)
    loaded_dict, original = loaded.to_dict(), config.to_dict()
    assert loaded_dict.pop("_name_or_path") == str(tmp_path)
    original.pop("_name_or_path")
    assert loaded_dict == original
    assert loaded.fusion_dropout == 0.2 and loaded.pooling_mode == "cls" and loaded.num_labels == tester.num_labels
    assert loaded.vision_bridge_layers == config.vision_bridge_layers


def test_default_config_builds_small_vit_and_bert():
    config = MMFusionConfig()
    assert config.vision_config.model_type == "vit" and config.text_config.model_type == "bert"
    assert config.fusion_type == "hierarchical" and config.vision_bridge_layers == [5, 6]
    assert config.text_bridge_layers == [5, 6] and config.fusion_layer_order == "self_first"
    assert MMFusionConfig(text_bridge_layers=["words", 6]).text_bridge_layers == ["words", 6]
    with pytest.raises(ValueError, match=r'`text_bridge_layers` \[\'word\', 6\] must be layer numbers or "words"'):
        MMFusionConfig(text_bridge_layers=["word", 6])
    with pytest.raises(ValueError, match=r'`text_bridge_layers` \[\'words\', 7\] must lie in \[0, 6\] or "words"'):
        MMFusionConfig(text_bridge_layers=["words", 7])
    with pytest.raises(ValueError, match=r"`vision_bridge_layers` \['words', 6\] must be layer numbers\."):
        MMFusionConfig(vision_bridge_layers=["words", 6])
    with pytest.raises(ValueError, match="Unknown fusion_layer_order 'cross'; orders are cross_first, self_first"):
        MMFusionConfig(fusion_layer_order="cross")


def test_a_config_without_fusion_layer_order_loads_self_first(tester, tmp_path):
    """A config that lacks `fusion_layer_order` (saved by a version without the option, whose layers attend to
    themselves first) loads as `self_first`, and a config that has it keeps its order."""
    for order in ("cross_first", "self_first"):
        tester.config(fusion_layer_order=order).save_pretrained(tmp_path / order)
        assert AutoConfig.from_pretrained(tmp_path / order).fusion_layer_order == order
    saved = json.loads((tmp_path / "cross_first" / "config.json").read_text())
    del saved["fusion_layer_order"]
    (tmp_path / "cross_first" / "config.json").write_text(json.dumps(saved))
    assert AutoConfig.from_pretrained(tmp_path / "cross_first").fusion_layer_order == "self_first"


@pytest.mark.parametrize("direction", ["bidirectional", "text_to_image"])
def test_cross_first_layers_read_the_image_with_each_words_own_query(tester, direction):
    """With `cross_first` and the first text bridge on the word embeddings (as the Sort-of-CLEVR recipe sets them), a
    word's first read of the image depends on the word alone, not on where it stands or on the rest of the sentence:
    two questions that share a word at different places read the image alike there. The other order, the tower's
    embeddings with positions (hidden state 0) or its last layer mix the place or the sentence in."""
    inputs = tester.inputs(batch_size=2)
    inputs["pixel_values"] = inputs["pixel_values"][:1].expand(2, -1, -1, -1)  # one image, two texts
    inputs["attention_mask"] = torch.ones_like(inputs["attention_mask"])
    inputs["input_ids"] = torch.randint(1, tester.vocab_size, inputs["input_ids"].shape, generator=torch.Generator())
    inputs["input_ids"][1, 5] = inputs["input_ids"][0, 3]  # the shared word: place 3 of the first, 5 of the second

    def first_read(**settings) -> torch.Tensor:
        torch.manual_seed(0)
        words = {"fusion_layer_order": "cross_first", "text_bridge_layers": ["words", 2]} | settings
        config = _small_config(tester, fusion_direction=direction, init_scheme="pytorch", **words)  # not uniform
        model = _eager_copy(MMFusionForImageTextClassification(config).eval())
        with torch.no_grad():
            first = model(**inputs, output_attentions=True).text_to_image_attentions[0]  # (2, heads, T, P)
        return torch.stack([first[0, :, 3], first[1, :, 5]])

    own = first_read()
    assert (own[0] - own[1]).abs().max() < 1e-7  # the same query and keys: equal up to rounding
    for other in (
        {"fusion_layer_order": "self_first"},
        {"text_bridge_layers": [0, 2]},
        {"text_bridge_layers": [2, 2]},
    ):
        mixed = first_read(**other)
        assert (mixed[0] - mixed[1]).abs().max() > 1e-5, other  # a tower at N(0, 0.02) mixes a little


def test_towers_from_other_families(tester):
    """Any transformers encoder config works as a tower, e.g. CLIP's vision tower with a RoBERTa text tower."""
    vision = CLIPVisionConfig(
        image_size=30, patch_size=3, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4
    )
    text = AutoConfig.for_model("roberta", vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)
    model = MMFusionForImageTextClassification(
        MMFusionConfig(vision_config=vision, text_config=text, num_labels=3, fusion_hidden_size=48, projection_dim=8)
    ).eval()
    inputs = tester.inputs()
    inputs["input_ids"] = inputs["input_ids"].clamp(min=2)
    assert model(**inputs).logits.shape == (tester.batch_size, 3)


# transformers' model API: hidden states, attentions, attention implementations, tuples, embeddings --------------
# (tests/test_model_common.py runs transformers' own ModelTesterMixin as well, when its sdist is at hand)


def _float_tensors(output, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every floating-point tensor of a (nested) model output, by dotted name."""
    if isinstance(output, torch.Tensor):
        return {prefix: output} if output.is_floating_point() else {}
    items = output.items() if isinstance(output, dict) else enumerate(output or ())
    tensors = {}
    for key, value in items:
        tensors.update(_float_tensors(value, f"{prefix}.{key}" if prefix else str(key)))
    return tensors


def _eager_copy(model):
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    return eager


# Each fusion type in each direction ("late" has no fusion layers, so its direction changes nothing).
FUSION_VARIANTS = [(t, d) for t in ("hierarchical", "cross_attention") for d in ("bidirectional", "text_to_image")]
FUSION_VARIANTS.append(("late", "bidirectional"))
SMALL_PATCH = 6  # 30 px images in 6 px patches: 26 image tokens instead of 226, for the heavier tests below
NUM_IMAGE_TOKENS = (30 // SMALL_PATCH) ** 2 + 1


def _small_config(tester, fusion_type: str = "hierarchical", **kwargs) -> MMFusionConfig:
    return tester.config(fusion_type, vision_config=tester.vision_config(patch_size=SMALL_PATCH), **kwargs)


@pytest.mark.parametrize("fusion_type, direction", FUSION_VARIANTS)
@pytest.mark.parametrize("head", HEADS)
def test_eager_attention_matches_sdpa(tester, head, fusion_type, direction):
    """Every output, hidden states of the towers and fusion streams included, agrees between the implementations."""
    model = head(_small_config(tester, fusion_type, fusion_direction=direction)).eval()
    eager = _eager_copy(model)
    assert model.config._attn_implementation == "sdpa" and eager.config._attn_implementation == "eager"
    for attention in (m for m in eager.modules() if type(m).__name__ == "MMFusionAttention"):
        assert attention.config._attn_implementation == "eager"
    inputs = tester.inputs(batch_size=4)  # texts of different lengths: padding is masked
    cases = [inputs]
    if head is not MMFusionForPretraining:  # images shared by several texts
        cases.append({**inputs, "pixel_values": inputs["pixel_values"][:2], "image_index": torch.tensor([0, 1, 1, 0])})
    for case in cases:
        with torch.no_grad():
            expected = _float_tensors(model(**case, output_hidden_states=True))
            got = _float_tensors(eager(**case, output_hidden_states=True))
        assert len(got) >= 8
        _assert_close(got, expected, atol=1e-5)


@pytest.mark.parametrize("fusion_type, direction", FUSION_VARIANTS)
@pytest.mark.parametrize("head", HEADS)
def test_hidden_states_and_attentions_of_towers_and_fusion_layers(tester, head, fusion_type, direction):
    model = _eager_copy(head(_small_config(tester, fusion_type, fusion_direction=direction)).eval())
    inputs = tester.inputs()
    B, T, P, L, H = tester.batch_size, tester.seq_length, NUM_IMAGE_TOKENS, 2, 4
    fused = fusion_type != "late"
    with torch.no_grad():
        plain = model(**inputs)
        out = model(**inputs, output_hidden_states=True, output_attentions=True)
    expected = expected_output_shapes(B, T, P, 32, H, L, fusion_type, direction)
    for name, shapes in expected.items():
        assert getattr(plain, name) is None, name
        if shapes is None:
            assert getattr(out, name) is None, name
            continue
        assert [tuple(t.shape) for t in getattr(out, name)] == [shapes[1]] * shapes[0], name
    # Requesting them changes nothing else.
    plain, out_tensors = _float_tensors(plain), _float_tensors(out)
    _assert_close({name: out_tensors[name] for name in plain}, plain, atol=0)
    if fused:
        padding = inputs["attention_mask"] == 0
        for probs in out.text_to_image_attentions:
            torch.testing.assert_close(probs.sum(-1), torch.ones(B, H, T))
        for probs in out.fusion_text_self_attentions + (out.image_to_text_attentions or ()):
            assert float(probs.masked_select(padding[:, None, None, :]).abs().max()) == 0.0  # no attention to padding


@pytest.mark.parametrize("direction", ["bidirectional", "text_to_image"])
def test_text_to_image_attentions_are_one_map_per_text_when_texts_share_images(tester, direction):
    """The attention-map field: (batch, heads, text_len, num_image_tokens) per fusion layer, one map per text."""
    model = _eager_copy(MMFusionForImageTextClassification(_small_config(tester, fusion_direction=direction)).eval())
    inputs = tester.inputs(batch_size=4)
    images, image_index = inputs["pixel_values"][:2], torch.tensor([0, 1, 1, 0])
    with torch.no_grad():
        shared = model(**{**inputs, "pixel_values": images}, image_index=image_index, output_attentions=True)
        repeated = model(**{**inputs, "pixel_values": images[image_index]}, output_attentions=True)
    assert len(shared.text_to_image_attentions) == 2  # one per fusion layer
    for a, b in zip(shared.text_to_image_attentions, repeated.text_to_image_attentions, strict=True):
        assert a.shape == (4, 4, tester.seq_length, NUM_IMAGE_TOKENS)
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert shared.vision_attentions[0].shape[0] == 2  # the vision tower saw each image once


def test_attentions_need_the_eager_implementation_chosen_the_transformers_way(tester, tmp_path):
    inputs = tester.inputs()
    model = MMFusionModel(_small_config(tester)).eval()
    # SDPA computes no probabilities: as transformers 5.23 does for its own models, it warns and returns none.
    with torch.no_grad():
        out = model(**inputs, output_attentions=True)
    assert out.text_attentions == () and out.text_to_image_attentions == () and out.image_to_text_attentions == ()
    with pytest.raises(ValueError, match="set it to 'eager'"):
        model.config.output_attentions = True
    model.save_pretrained(tmp_path)
    for eager in (
        MMFusionModel(_small_config(tester, attn_implementation="eager")),
        MMFusionModel.from_pretrained(tmp_path, attn_implementation="eager"),
        _eager_copy(model),
    ):
        configs = (eager.config, eager.vision_model.config, eager.text_model.config)
        assert [c._attn_implementation for c in configs] == ["eager"] * 3
        with torch.no_grad():
            out = eager.eval()(**inputs, output_attentions=True)
        assert len(out.text_to_image_attentions) == 2 and len(out.text_attentions) == 2


def test_output_hidden_states_is_a_flag_not_a_list_of_layers(tester):
    """Two towers and two fusion streams have no single layer numbering: a list of layers to keep is refused."""
    model = MMFusionModel(_small_config(tester)).eval()
    with pytest.raises(TypeError, match="`output_hidden_states` must be True or False"):
        model(**tester.inputs(), output_hidden_states=[0, 2])


@pytest.mark.parametrize("head", HEADS)
def test_return_dict_false_gives_tuples(tester, head):
    model = head(_small_config(tester)).eval()
    inputs = tester.inputs()
    with torch.no_grad():
        as_dict = model(**inputs, output_hidden_states=True)
        as_tuple = model(**inputs, output_hidden_states=True, return_dict=False)
        model.config.return_dict = False
        from_config = model(**inputs)
    assert isinstance(as_tuple, tuple) and isinstance(from_config, tuple)
    # The non-None fields in the order the output class declares them, the nested tower outputs as tuples too.
    fields = [f.name for f in dataclasses.fields(as_dict) if getattr(as_dict, f.name) is not None]
    assert list(as_dict.keys()) == fields and len(as_tuple) == len(fields)
    _assert_close(_float_tensors(as_tuple), _float_tensors(as_dict.to_tuple()), atol=0)
    torch.testing.assert_close(from_config[0], as_tuple[0], atol=0, rtol=0)


@pytest.mark.parametrize("fusion_type", FUSION_TYPES)
def test_image_and_text_features_are_outputs_with_pooling_as_in_clip(tester, fusion_type):
    model = MMFusionModel(tester.config(fusion_type)).eval()
    inputs = tester.inputs()
    num_patches = (tester.image_size // 2) ** 2 + 1
    with torch.no_grad():
        image = model.get_image_features(inputs["pixel_values"], output_hidden_states=True)
        text = model.get_text_features(inputs["input_ids"], inputs["attention_mask"], output_hidden_states=True)
        image_tuple = model.get_image_features(inputs["pixel_values"], return_dict=False)
        fused = model(**inputs)
    assert image.pooler_output.shape == text.pooler_output.shape == (tester.batch_size, 16)
    assert image.last_hidden_state.shape == (tester.batch_size, num_patches, 32) and len(image.hidden_states) == 3
    assert text.last_hidden_state.shape == (tester.batch_size, tester.seq_length, 32) and len(text.hidden_states) == 3
    assert image.attentions is None and isinstance(image_tuple, tuple)
    torch.testing.assert_close(image_tuple[1], image.pooler_output, atol=0, rtol=0)
    if fusion_type == "late":  # the late-fusion pooled vectors are these embeddings
        torch.testing.assert_close(fused.image_pooled, image.pooler_output, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(fused.text_pooled, text.pooler_output, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("head", HEADS)
def test_resize_token_embeddings_after_adding_tokens(tester, tmp_path, head):
    from mm_fusion import train_tokenizer

    corpus = ["what color is the circle?", "is there a blue triangle?", "what shape is present?"]
    tokenizer = train_tokenizer(corpus, vocab_size=60)
    config = tester.config(text_config=tester.text_config(vocab_size=len(tokenizer)))
    model = head(config).eval()
    assert model.get_input_embeddings() is model.base_model.text_model.embeddings.word_embeddings
    tokenizer.add_tokens(["<hexagon>", "<octagon>"])
    model.resize_token_embeddings(len(tokenizer))
    assert model.config.text_config.vocab_size == len(tokenizer) == model.get_input_embeddings().num_embeddings
    batch = tokenizer(["is there a <hexagon>?", "what color is the <octagon>?"], padding=True, return_tensors="pt")
    assert int(batch["input_ids"].max()) == len(tokenizer) - 1  # a new token is in the batch
    inputs = {**batch, "pixel_values": tester.inputs(batch_size=2)["pixel_values"]}
    model.save_pretrained(tmp_path)
    reloaded = head.from_pretrained(tmp_path).eval()
    assert reloaded.config.text_config.vocab_size == len(tokenizer)
    _assert_close(_outputs(model, inputs), _outputs(reloaded, inputs), atol=0)


@pytest.mark.parametrize("head", HEADS)
def test_main_input_name_is_the_first_forward_argument(tester, head):
    assert list(inspect.signature(head.forward).parameters)[1] == head.main_input_name == "input_ids"
    model = head(tester.config()).eval()
    inputs = tester.inputs()
    with pytest.raises(ValueError, match=r"first two arguments are \(input_ids, pixel_values\)"):
        model(inputs["pixel_values"], inputs["input_ids"])  # the order before transformers' convention


@pytest.mark.parametrize("fusion_type", FUSION_TYPES)
def test_pretraining_scores_n_texts_against_m_images_clip_style(tester, fusion_type):
    """Zero-shot classification's call: N label prompts against one image (or M images), without the loss."""
    model = MMFusionForPretraining(tester.config(fusion_type)).eval()
    inputs = tester.inputs(batch_size=4)
    texts = {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]}
    with torch.no_grad():
        paired = model(**inputs)
        for num_images in (1, 3):
            out = model(**texts, pixel_values=inputs["pixel_values"][:num_images], output_hidden_states=True)
            assert out.logits_per_image.shape == (num_images, 4) and out.logits_per_text.shape == (4, num_images)
            torch.testing.assert_close(out.logits_per_image, paired.logits_per_image[:num_images])
            torch.testing.assert_close(out.logits_per_text, paired.logits_per_text[:, :num_images])
            assert out.itm_logits is None and out.fusion_text_hidden_states is None  # matching needs pairs
            assert len(out.text_hidden_states) == 3 and out.vision_hidden_states[0].shape[0] == num_images
    with pytest.raises(ValueError, match="return_loss needs one image per text.*1 images and input_ids 4 texts"):
        model(**texts, pixel_values=inputs["pixel_values"][:1], return_loss=True)


# Bad input gets a clear error -------------------------------------------------------------------------------------


def test_error_batch_size_mismatch_names_both_sizes(tester):
    model = MMFusionModel(tester.config()).eval()
    inputs = tester.inputs(batch_size=3)
    inputs["pixel_values"] = inputs["pixel_values"][:2]
    with pytest.raises(ValueError, match=r"pixel_values has 2 images but input_ids has 3 texts"):
        model(**inputs)


@pytest.mark.parametrize("missing", ["pixel_values", "input_ids"])
@pytest.mark.parametrize("head", HEADS)
def test_error_missing_input(tester, missing, head):
    model = head(tester.config()).eval()
    inputs = tester.inputs()
    inputs.pop(missing)
    with pytest.raises(ValueError, match=f"missing: {missing}"):
        model(**inputs)


def test_error_unknown_fusion_type_lists_valid_ones(tester):
    with pytest.raises(ValueError, match="'concat'.*hierarchical, cross_attention, late"):
        tester.config("concat")


def test_error_vision_config_that_is_not_a_vision_encoder(tester):
    with pytest.raises(ValueError, match="`vision_config` must be a vision encoder.*BertConfig"):
        MMFusionConfig(vision_config=BertConfig(), text_config=tester.text_config())
    with pytest.raises(ValueError, match="`vision_config`.*CLIPConfig.*vision/text sub-config"):
        MMFusionConfig(vision_config=CLIPConfig(), text_config=tester.text_config())
    with pytest.raises(ValueError, match="`text_config` must be a text encoder.*ViTConfig"):
        MMFusionConfig(vision_config=tester.vision_config(), text_config=tester.vision_config())


def test_config_fields_are_declared_and_documented():
    """Every setting is a declared field of the config (a dataclass, as transformers 5 declares its configs), and the
    docstring documents exactly those fields, in their order."""
    own = [f.name for f in dataclasses.fields(MMFusionConfig) if f.name not in BASE_CONFIG_FIELDS]
    documented = re.findall(r"^        (\w+) \(`", MMFusionConfig.__doc__, re.M)
    assert own == documented
    assert len(own) == 35 and own[:2] == ["vision_config", "text_config"]


def test_config_refuses_a_value_of_the_wrong_type_naming_the_field(tester):
    with pytest.raises(StrictDataclassFieldValidationError, match="num_fusion_layers.*expected int, got str"):
        tester.config(num_fusion_layers="2")
    config = tester.config()
    with pytest.raises(StrictDataclassFieldValidationError, match="vision_film.*expected bool"):
        config.vision_film = "yes"
    assert config.vision_film is False


def test_config_pixel_normalisation_per_channel_or_one_number(tester):
    config = tester.config(image_mean=0.5, image_std=(0.2, 0.25, 0.3))
    assert config.image_mean == [0.5, 0.5, 0.5] and config.image_std == [0.2, 0.25, 0.3]
    with pytest.raises(ValueError, match=r"need 3 values \(one per channel, std > 0\); got \[0.5, 0.5\] and"):
        tester.config(image_mean=[0.5, 0.5])
    with pytest.raises(ValueError, match="std > 0"):
        tester.config(image_std=0)


def test_error_bridge_layers(tester):
    with pytest.raises(ValueError, match="`text_bridge_layers` has 1 entries but num_fusion_layers is 2"):
        tester.config(text_bridge_layers=[1])
    with pytest.raises(ValueError, match=r"`vision_bridge_layers` \[1, 7\] must lie in \[0, 2\]"):
        tester.config(vision_bridge_layers=[1, 7])


@pytest.mark.parametrize("fusion_type", ["cross_attention", "late"])
@pytest.mark.parametrize(
    "setting",
    [
        {"vision_bridge_layers": [1, 2]},
        {"text_bridge_layers": ["words", 2]},
        {"vision_bridge_layers": [1, 2], "vision_config": "resnet"},  # a backbone's stages: the last one is read
    ],
)
def test_error_bridge_layers_without_hierarchical_fusion(tester, tmp_path, fusion_type, setting):
    # Only hierarchical fusion has bridges: set for another fusion type, they were dropped without a word.
    setting = dict(setting)
    if setting.get("vision_config") == "resnet":
        setting["vision_config"] = tester.resnet_config()
    (name, layers), *_ = setting.items()
    message = (
        rf"`{name}` {re.escape(str(layers))} choose the tower layers that feed the hierarchical bridges, but "
        rf"fusion_type '{fusion_type}' has none: .* Leave `{name}` unset, or use fusion_type 'hierarchical'"
    )
    with pytest.raises(ValueError, match=message):
        tester.config(fusion_type, **setting)
    # Unset they stay None, as configs of these types were always saved, and such a config loads.
    config = tester.config(fusion_type, **{k: v for k, v in setting.items() if k != name})
    assert (config.vision_bridge_layers, config.text_bridge_layers) == (None, None)
    config.save_pretrained(tmp_path)
    assert MMFusionConfig.from_pretrained(tmp_path).to_dict()[name] is None
    # The layers as given are what hierarchical fusion reads.
    assert getattr(tester.config("hierarchical", **setting), name) == layers


def test_error_labels_out_of_range(tester):
    model = MMFusionForImageTextClassification(tester.config()).eval()
    inputs = tester.inputs()
    with pytest.raises(ValueError, match=r"class indices in \[0, 5\).*got \[7\]"):
        model(**inputs, labels=torch.tensor([0, 7, 1]))
    with pytest.raises(ValueError, match=r"got \[-3\]"):
        model(**inputs, labels=torch.tensor([0, -3, 1]))
    with pytest.raises(ValueError, match=r"shape \(batch_size, num_labels\) = \(3, 5\); got \(3, 4\)"):
        model(**inputs, labels=torch.zeros(3, 4))
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        model(**inputs, labels=torch.full((3, 5), 2.0))
    # -100 is the ignore index and is accepted.
    assert torch.isfinite(model(**inputs, labels=torch.tensor([0, -100, 1])).loss)


@pytest.mark.parametrize(
    "head, typo",
    [(MMFusionForImageTextClassification, "lables"), (MMFusionForPretraining, "retrun_loss"), (MMFusionModel, "imgs")],
)
def test_error_misspelt_keyword_argument(tester, head, typo):
    """A misspelt keyword (`lables` for `labels`) is a TypeError naming it, not swallowed by `**kwargs`."""
    model = head(tester.config()).eval()
    with pytest.raises(TypeError, match=typo):
        model(**tester.inputs(), **{typo: torch.tensor([0, 1, 2])})


@pytest.mark.parametrize("head", HEADS)
def test_collator_bookkeeping_keys_are_accepted_and_ignored(tester, head):
    model = head(tester.config()).eval()
    inputs = tester.inputs()
    extra = {"image_rows": torch.tensor([4, 4, 9]), "sample_ids": ["a", "b", "c"]}
    _assert_close(_outputs(model, {**inputs, **extra}), _outputs(model, inputs), atol=0)


def test_error_empty_batch_and_texts_longer_than_the_positions(tester):
    model = MMFusionForImageTextClassification(tester.config()).eval()
    inputs = tester.inputs()
    with pytest.raises(ValueError, match="Empty batch: pixel_values holds 0 images and input_ids 0 texts"):
        model(**{k: v[:0] for k, v in inputs.items()})
    too_long = torch.ones(3, 65, dtype=torch.long)  # the tiny BERT has 64 positions
    with pytest.raises(ValueError, match="input_ids has 65 tokens per text.*position embeddings for 64.*max_length"):
        model(pixel_values=inputs["pixel_values"], input_ids=too_long)


def test_error_image_index_outside_the_images(tester):
    model = MMFusionForImageTextClassification(tester.config()).eval()
    inputs = tester.inputs()
    pixel_values = inputs["pixel_values"][:2]
    for bad in ([0, -1, 1], [0, 2, 1]):  # -1 is refused, not read as the last image
        with pytest.raises(ValueError, match=rf"rows of pixel_values in \[0, 2\); got \[{bad[1]}\]"):
            model(**{**inputs, "pixel_values": pixel_values}, image_index=torch.tensor(bad))


def test_integer_pixels_are_read_as_0_255_not_as_normalised(tester):
    model = MMFusionForImageTextClassification(tester.config()).eval()
    inputs = tester.inputs()
    pixels = torch.randint(0, 256, inputs["pixel_values"].shape, generator=torch.Generator().manual_seed(0))
    as_uint8 = _outputs(model, {**inputs, "pixel_values": pixels.to(torch.uint8)})
    for dtype in (torch.int64, torch.int32, torch.int16):
        _assert_close(_outputs(model, {**inputs, "pixel_values": pixels.to(dtype)}), as_uint8, atol=0)
    with pytest.raises(ValueError, match=r"Integer pixel_values \(torch.int64\).*range over \[0, 300\]"):
        model(**{**inputs, "pixel_values": pixels.clamp(max=254).index_fill(0, torch.tensor([1]), 300)})
