"""scripts/benchmarks/profile_training_step.py: the breakdown, the levers and the reads, end to end at a small size."""

import json
import platform

import pytest
import torch


@pytest.fixture(scope="module")
def profile():
    import profile_training_step  # scripts/benchmarks is on sys.path (conftest.py)

    return profile_training_step


@pytest.fixture(scope="module")
def tiny_default_trainer(tmp_path_factory):
    """The default model of scripts/train.py at 32 px on 256 questions."""
    from mm_fusion.training.run import setup_run

    out = tmp_path_factory.mktemp("run")
    args = ["--output_dir", str(out), "--max_steps", "1", "--eval_strategy", "no", "--save_strategy", "no"]
    return setup_run([*args, "--report_to", "none", "--max_train_samples", "256", "--image_size", "32"])


def test_levers_switch_what_they_name(profile, tiny_default_trainer):
    """Each lever off gives the model as it ran before: the tower's input in NCHW, every read projected through
    SDPA; and the batch without `share` holds one image per question."""
    model = tiny_default_trainer.model
    batch = next(iter(tiny_default_trainer.get_train_dataloader()))
    assert len(batch["pixel_values"]) < len(batch["input_ids"])  # grouped by image: something to share
    seen = {}

    def layout(module, args, kwargs):
        pixels = kwargs["pixel_values"]
        seen["channels_last"] = pixels.is_contiguous(memory_format=torch.channels_last) and not pixels.is_contiguous()

    read = model.mm_fusion.vision_encoder.vision_text_attention.reads[0]
    with torch.no_grad():
        for on in ((), profile.LEVERS):
            with profile.levers(model, on):
                hook = model.mm_fusion.vision_model.register_forward_pre_hook(layout, with_kwargs=True)  # runs last
                model(**profile.batch_for(batch, on))
                hook.remove()
                assert seen["channels_last"] == ("channels_last" in on)
                assert read._factored_pays(256, 24, 12) == ("factored_read" in on)
    unshared = profile.batch_for(batch, ())
    assert "image_index" not in unshared and len(unshared["pixel_values"]) == len(batch["input_ids"])
    torch.testing.assert_close(unshared["pixel_values"], batch["pixel_values"][batch["image_index"]])


def test_profile_end_to_end(profile, tmp_path):
    output = tmp_path / "profile"
    report = profile.main(
        ["--steps", "2", "--repeats", "1", "--read_tokens", "8", "--variants", "before,shipped", "--evaluate", "False",
         "--train_args", "--max_train_samples 256 --image_size 32", "--output", str(output)]
    )  # fmt: skip
    written = json.loads(output.with_suffix(".json").read_text())
    assert [r["variant"] for r in written["steps"]] == ["before", "shipped"]
    assert all(r["step_ms"] > 0 and r["minor_faults_per_step"] >= 0 for r in written["steps"])
    # glibc keeps freed memory in the process, as the Trainer's steps find it (benchmarking.reuse_freed_memory).
    assert written["machine"]["reuses_freed_memory"] == (platform.libc_ver()[0] == "glibc")
    parts = [r["part"] for r in written["breakdown"]["shipped"]]
    assert parts[:3] == ["stem", "stage 1", "stage 1 read"] and parts[-2:] == ["fusion", "head"]
    before, shipped = report["breakdown"]["before"], report["breakdown"]["shipped"]
    # Shared: the stem and the first stage see the distinct images, the rest one row per question.
    assert shipped[0]["rows"] < before[0]["rows"] == shipped[-1]["rows"]
    assert len(report["read"]) == 3 and {r["picked"] for r in report["read"]} <= {"factored", "projected"}
