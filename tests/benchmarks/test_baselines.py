"""scripts/benchmarks/baselines.py: the recipe the contenders share, the seed-style model, and no command."""

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
    assert recipe["learning_rate"] == training["learning_rate"]
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
