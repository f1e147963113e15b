"""scripts/benchmarks/baselines.py: the recipe and default model the contenders share, the seed-style model, and no
command."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import BertConfig, ViTConfig


SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "benchmarks" / "baselines.py"


@pytest.fixture(scope="module")
def baselines():
    import baselines  # scripts/benchmarks is on sys.path (conftest.py)

    return baselines


def test_help_says_it_has_no_command():
    done = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: baselines.py\n") and "no command" in done.stdout
    assert subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True).returncode != 0


def test_recipe_is_read_from_the_argument_defaults(baselines):
    from mm_fusion.training import DataArguments, MMFusionTrainingArguments, ModelArguments

    recipe = baselines.recipe()
    training = {f.name: f.default for f in dataclasses.fields(MMFusionTrainingArguments)}
    assert recipe["learning_rate"] == MMFusionTrainingArguments(output_dir="x").learning_rate > 0
    assert recipe["weight_decay"] == training["weight_decay"]
    assert recipe["batch_size"] == training["per_device_train_batch_size"]
    assert recipe["dropout"] == ModelArguments().dropout
    assert recipe["max_length"] == DataArguments().max_length


def test_seed_model_ignores_padding(baselines):
    torch.manual_seed(0)
    vision = ViTConfig(image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=1, num_attention_heads=4)
    text = BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64)
    model = baselines.SeedStyleModel(vision, text, num_labels=5, num_fusion_layers=2, dropout=0.1).eval()
    pixel_values = torch.randn(2, 3, 16, 16)
    input_ids = torch.tensor([[2, 7, 8, 3, 0, 0], [2, 9, 3, 0, 0, 0]])
    attention_mask = (input_ids != 0).long()
    loss, logits = model(pixel_values, input_ids, attention_mask, labels=torch.tensor([1, 4]))
    assert logits.shape == (2, 5) and torch.isfinite(loss)
    other_padding = input_ids.masked_fill(attention_mask == 0, 11)  # other ids under the mask: same logits
    torch.testing.assert_close(model(pixel_values, other_padding, attention_mask)[1], logits)


def test_default_model_is_the_one_train_py_builds(baselines):
    from mm_fusion import MMFusionForImageTextClassification, train_tokenizer
    from mm_fusion.training import ModelArguments, build_config
    from mm_fusion.training.models import preset_settings

    tokenizer = train_tokenizer(["what color is the circle?", "is there a triangle?"], vocab_size=100)
    labels = ["yes", "no", "red"]
    model = baselines.default_model(tokenizer, labels, 64, 64, seed=0)
    assert type(model) is MMFusionForImageTextClassification
    expected = build_config(ModelArguments(), 64, len(tokenizer), 64, labels).to_dict()
    assert model.config.to_dict() == {**expected, "problem_type": "single_label_classification"}
    for name, value in preset_settings(ModelArguments(), {}).items():  # the default preset's, none overridden
        assert getattr(model.config, name) == value
    # Longer texts (the seed pipeline's 512 tokens): more BERT positions, the rest alike.
    longer = baselines.default_model(tokenizer, labels, 64, baselines.SEED_MAX_LENGTH, seed=0).config.to_dict()
    assert longer["text_config"].pop("max_position_embeddings") == baselines.SEED_MAX_LENGTH
    expected["text_config"].pop("max_position_embeddings")
    assert longer == {**expected, "problem_type": "single_label_classification"}
