"""
The ITC gradient cache (`itc_grad_cache`, mm_fusion/training/grad_cache.py) and ITM negatives from the global batch.

- One `MMFusionTrainer` step of 4 micro-batches x 4 pairs equals one contrastive loss over the 16 pairs with the full
  autograd graph (loss and every gradient within 1e-5), with dropout (the reference encodes the 4 chunks in order from
  the step's RNG state, so the masks match) and without (the reference is one forward at batch 16).
- The control: without the cache the same comparison fails. `MM_FUSION_DISABLE_GRAD_CACHE=1` runs the equality tests
  themselves with the cache off, to watch them fail.
- 2 processes x 2 micro-batches x 4 equal 1 process x 16 (torchrun, gloo; no dropout: the ranks draw their own masks).
- ITM: 2 processes x 4 pairs draw the same global hard negatives as 1 process x 8, with the same loss and gradients.
- Memory (the cached step keeps one micro-batch of activations): tests/benchmarks/test_benchmark_grad_cache.py.
"""

import os

import pytest
import torch
import torch.nn.functional as F
from helpers.grad_cache_worker import collate, itm_batch, model_inputs, pairs, tiny_config, train_one_step
from helpers.launch import run_worker

from mm_fusion import MMFusionForPretraining


TOL = 1e-5
CACHE_ON = os.environ.get("MM_FUSION_DISABLE_GRAD_CACHE") != "1"


def fresh_model(config, initial=None):
    torch.manual_seed(0)
    model = MMFusionForPretraining(config)
    if initial is not None:
        model.load_state_dict(initial)
    return model


def reference(model, samples, chunks: int, rng_state=None) -> tuple[float, dict]:
    """One contrastive loss over all samples, full autograd graph: embedded in `chunks` chunks in order (1 = a plain
    forward), from `rng_state`."""
    model.train().zero_grad()
    if rng_state is not None:
        torch.set_rng_state(rng_state)
    batch = model_inputs(collate(samples))
    if chunks == 1:
        loss = model(**batch, return_loss=True).loss
    else:
        images, texts = [], []
        for part in range(chunks):
            size = len(samples) // chunks
            encoded = model.mm_fusion.encode(**{k: v[part * size : (part + 1) * size] for k, v in batch.items()})
            images.append(F.normalize(encoded.image_embeds, dim=-1))
            texts.append(F.normalize(encoded.text_embeds, dim=-1))
        loss = model.contrastive_loss(torch.cat(images), torch.cat(texts), gather=False)[0]
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def differences(loss, grads, ref_loss, ref_grads) -> list[str]:
    """What is not within `TOL` (absolute + relative) of the reference: the loss, and each differing gradient."""
    assert grads.keys() == ref_grads.keys()
    found = [f"loss {loss:.6f} vs {ref_loss:.6f}"] if abs(loss - ref_loss) > TOL + TOL * abs(ref_loss) else []
    for name, ref in ref_grads.items():
        if not torch.allclose(grads[name], ref, atol=TOL, rtol=TOL):
            found.append(f"{name}: max |diff| {(grads[name] - ref).abs().max().item():.3g}")
    return found


def assert_equal_to_reference(loss, grads, ref_loss, ref_grads):
    found = differences(loss, grads, ref_loss, ref_grads)
    assert not found, f"{len(found)} of 1 loss + {len(ref_grads)} gradients differ beyond {TOL}:\n" + "\n".join(
        found[:8]
    )


def trainer_step(tmp_path, dropout: float, grad_cache: bool):
    config = tiny_config(dropout=dropout)
    model = fresh_model(config)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    samples = pairs(16)
    logs, capture, _ = train_one_step(model, samples, tmp_path, batch_size=4, accumulation=4, grad_cache=grad_cache)
    chunks = 4 if dropout > 0 else 1
    ref = reference(fresh_model(config, initial), samples, chunks, capture.rng_state)
    return logs, capture.grads, ref


@pytest.mark.parametrize("dropout", [0.1, 0.0])
def test_accumulated_step_equals_one_big_batch(tmp_path, dropout):
    logs, grads, (ref_loss, ref_grads) = trainer_step(tmp_path, dropout, grad_cache=CACHE_ON)
    assert_equal_to_reference(logs["loss"], grads, ref_loss, ref_grads)
    assert logs["itc_loss"] == pytest.approx(logs["loss"], rel=1e-6)  # ITM is off: the loss is all ITC


def test_without_the_cache_the_comparison_fails(tmp_path):
    """The control: each micro-batch contrasts its own 4 pairs, and the equality above is far from holding."""
    logs, grads, (ref_loss, ref_grads) = trainer_step(tmp_path, 0.1, grad_cache=False)
    assert abs(logs["loss"] - ref_loss) > 1000 * TOL
    assert len(differences(logs["loss"], grads, ref_loss, ref_grads)) > 0.9 * len(ref_grads)


def test_itm_under_the_cache_trains_every_part_and_logs_both_terms(tmp_path):
    config = tiny_config(dropout=0.1, itm_loss_weight=1.0)
    model = fresh_model(config)
    logs, capture, _ = train_one_step(model, pairs(16), tmp_path, batch_size=4, accumulation=2, grad_cache=True)
    assert logs["loss"] == pytest.approx(logs["itc_loss"] + logs["itm_loss"], rel=1e-5)
    assert {n for n, _ in model.named_parameters()} == set(capture.grads)  # fusion and ITM head included
    assert all(torch.isfinite(g).all() for g in capture.grads.values())


def test_evaluation_reports_the_training_losses(tmp_path):
    config = tiny_config(itm_loss_weight=0.5)
    model = fresh_model(config)
    _, _, trainer = train_one_step(
        model, pairs(8), tmp_path, batch_size=4, accumulation=2, grad_cache=True, per_device_eval_batch_size=8
    )
    metrics = trainer.evaluate(eval_dataset=pairs(10, seed=1))  # batches of 8 + 2
    assert metrics["eval_loss"] == pytest.approx(metrics["eval_itc_loss"] + 0.5 * metrics["eval_itm_loss"], rel=1e-5)
    model.eval()
    with torch.no_grad():
        batches = [collate(pairs(10, seed=1)[s : s + 8]) for s in (0, 8)]
        outs = [model(**model_inputs(b), return_loss=True) for b in batches]
    # Trainer's weighting of the loss: each batch's mean counted once per sample of a full batch, the padding dropped.
    expected_itc = (8 * outs[0].itc_loss + 2 * outs[1].itc_loss) / 10
    assert metrics["eval_itc_loss"] == pytest.approx(expected_itc.item(), rel=1e-5)


@pytest.mark.parametrize("fusion_type", ["hierarchical", "late"])
def test_encode_and_fuse_are_the_model_forward(fusion_type):
    """The public steps the pretraining head is built from give what `MMFusionModel` and its feature methods give."""
    model = fresh_model(tiny_config(fusion_type=fusion_type)).eval()
    base, batch = model.mm_fusion, model_inputs(collate(pairs(4)))
    with torch.no_grad():
        encoded = base.encode(**batch)
        fused = base.fuse(encoded.image_features, encoded.text_features, batch["attention_mask"])
        whole = base(**batch)
        image_features = base.get_image_features(batch["pixel_values"]).pooler_output
        text_features = base.get_text_features(batch["input_ids"], batch["attention_mask"]).pooler_output
    torch.testing.assert_close(fused.pooler_output, whole.pooler_output)
    torch.testing.assert_close(encoded.image_embeds, image_features)
    torch.testing.assert_close(encoded.text_embeds, text_features)


# ---- Two processes ----


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("grad_cache_2proc")
    run_worker("grad_cache_worker", out_dir, processes=2)
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(2)]


@pytest.mark.distributed
def test_two_ranks_with_accumulation_equal_one_process_with_the_whole_batch(two_ranks):
    """2 processes x 2 micro-batches x 4 pairs: ITC over all 16, as 1 process x 16 (dropout 0)."""
    assert two_ranks[0]["world_size"] == 2
    config = tiny_config()
    ref_loss, ref_grads = reference(fresh_model(config, two_ranks[0]["initial"]), pairs(16), chunks=1)
    for rank in two_ranks:
        assert_equal_to_reference(rank["itc"]["logs"]["loss"], rank["itc"]["grads"], ref_loss, ref_grads)


@pytest.mark.distributed
def test_two_ranks_with_itm_under_the_cache_stay_in_sync(two_ranks):
    first, second = (r["itm_cache"] for r in two_ranks)
    assert first["logs"]["itm_loss"] > 0 and first["grads"].keys() == second["grads"].keys()
    for name, grad in first["grads"].items():
        assert torch.equal(grad, second["grads"][name]), name


@pytest.mark.distributed
@pytest.mark.parametrize("direction", ["bidirectional", "text_to_image"])
def test_itm_hard_negatives_come_from_the_global_batch(two_ranks, direction):
    """2 ranks x 4 pairs draw, for a fixed seed, the global negatives of 1 process x 8, with the same loss and
    gradients (averaged over ranks, as DDP does)."""
    ranks = [r["itm"][direction] for r in two_ranks]
    assert ranks[0]["text_length"] > ranks[1]["text_length"]  # the ranks' texts were padded to a common length
    model = fresh_model(tiny_config(itm_loss_weight=1.0, fusion_direction=direction)).train()
    drawn = []
    sample = model._hard_negatives
    model._hard_negatives = lambda *a, **k: drawn.append(sample(*a, **k)) or drawn[-1]
    torch.manual_seed(123)
    out = model(**itm_batch(), return_loss=True)
    out.itm_loss.backward()
    negative_text, negative_image = drawn[0]
    assert torch.equal(torch.cat([r["negatives"][0] for r in ranks]), negative_text)
    assert torch.equal(torch.cat([r["negatives"][1] for r in ranks]), negative_image)
    assert (negative_text != torch.arange(8)).all() and (negative_image != torch.arange(8)).all()
    assert (negative_text // 4 != torch.arange(8) // 4).any()  # some negatives come from the other rank's pairs
    torch.testing.assert_close(ranks[0]["itm_loss"], out.itm_loss.detach(), atol=TOL, rtol=TOL)
    for name, p in model.named_parameters():
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        torch.testing.assert_close(ranks[0]["grads"][name], grad, atol=TOL, rtol=TOL, msg=name)
