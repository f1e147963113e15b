"""MMFusionProcessor and the tokenizer-training helper: outputs, save/load round trips, clear errors."""

import pytest
import torch
from helpers.data import CORPUS, random_images
from transformers import AutoProcessor, AutoTokenizer

from mm_fusion import MMFusionImageProcessor, MMFusionProcessor, train_tokenizer


@pytest.fixture
def processor() -> MMFusionProcessor:
    tokenizer = train_tokenizer(CORPUS, vocab_size=200, model_max_length=32)
    return MMFusionProcessor(MMFusionImageProcessor(size={"height": 30, "width": 30}), tokenizer)


def test_trained_tokenizer_is_bert_style_and_round_trips(tmp_path):
    tokenizer = train_tokenizer(CORPUS, vocab_size=200)
    assert tokenizer.pad_token_id == 0
    ids = tokenizer("Is there a BLUE circle?").input_ids
    assert ids[0] == tokenizer.cls_token_id and ids[-1] == tokenizer.sep_token_id
    assert tokenizer.unk_token_id not in ids  # every word was in the corpus (lower-casing included)
    assert tokenizer.decode(ids, skip_special_tokens=True) == "is there a blue circle?"
    assert tokenizer.unk_token_id in tokenizer("zebra").input_ids
    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    for text in CORPUS + ["an unseen zebra sentence"]:
        assert reloaded(text).input_ids == tokenizer(text).input_ids


def test_processor_returns_model_inputs(processor):
    batch = processor(images=random_images(2), text=CORPUS[:2], padding=True, return_tensors="pt")
    assert set(batch.keys()) == {"pixel_values", "input_ids", "attention_mask"}
    assert batch["pixel_values"].shape == (2, 3, 30, 30)
    assert batch["input_ids"].shape == batch["attention_mask"].shape
    assert batch["input_ids"].shape[0] == 2
    # Padding to the longest text: the shorter one is padded with pad id 0 and masked.
    lengths = batch["attention_mask"].sum(1)
    assert lengths.max() == batch["input_ids"].shape[1] and lengths.min() < lengths.max()
    assert (batch["input_ids"][batch["attention_mask"] == 0] == 0).all()


def test_processor_round_trips_through_auto_processor(processor, tmp_path):
    processor.save_pretrained(tmp_path)
    reloaded = AutoProcessor.from_pretrained(tmp_path)
    assert type(reloaded) is MMFusionProcessor
    images, text = random_images(3), CORPUS[:3]
    a = processor(images=images, text=text, padding=True, return_tensors="pt")
    b = reloaded(images=images, text=text, padding=True, return_tensors="pt")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_processor_refuses_mismatched_counts(processor):
    with pytest.raises(ValueError, match="Got 3 images and 2 texts"):
        processor(images=random_images(3), text=CORPUS[:2], padding=True)
    with pytest.raises(ValueError, match="Got 2 images and 1 texts"):
        processor(images=random_images(2), text=CORPUS[0])
