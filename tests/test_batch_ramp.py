"""The batch-size ramp (`--batch_size_ramp_max`): its plan, its batches and learning rates in a training run; and
`--auto_find_batch_size`: the batch the ranks agree on, and the memory probe that finds it."""

from collections import Counter

import pytest
import torch
from helpers.training import TINY

from mm_fusion.training import setup_run
from mm_fusion.training.batch_ramp import BatchRamp, RampBatchSampler


def test_plan_per_epoch_and_per_steps():
    ramp = BatchRamp(4, 12)  # the seeds' min(batch * (epoch + 1), max)
    assert ramp.plan(48, 1, 4) == [[4] * 12, [8] * 6, [12] * 4, [12] * 4]
    # two processes: each step takes size x 2 pairs; the last step of an epoch shares what is left
    assert ramp.plan(50, 2, 2) == [[4] * 6 + [1], [8, 8, 8, 1]]
    assert BatchRamp(2, 6, every_steps=3).plan(24, 1, 2) == [[2, 2, 2, 4, 4, 4, 6], [6, 6, 6, 6]]
    assert BatchRamp(4, 12).lr_factor(4) == pytest.approx(1 / 3)
    assert BatchRamp(4, 12, lr_scaling="sqrt").lr_factor(3) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="start <= maximum"):
        BatchRamp(8, 4)
    # a run given in steps: as many epochs as the steps need
    assert BatchRamp(4, 12).plan(48, 1, None, max_steps=20) == [[4] * 12, [8] * 6, [12] * 4]


def test_sampler_covers_each_epoch_once_with_one_batch_per_process_a_step():
    plan = BatchRamp(2, 4).plan(13, 2, 2)
    sampler = RampBatchSampler(13, plan, num_processes=2, seed=1)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        batches = list(sampler)
        assert len(batches) == len(sampler) == 2 * len(plan[epoch])
        assert [len(b) for b in batches[::2]] == [len(b) for b in batches[1::2]] == plan[epoch]
        seen = Counter(i for b in batches for i in b)
        assert max(seen.values()) == 1 and len(seen) == 12  # one pair left over (fewer than the 2 processes)


def test_a_ramped_run_grows_its_batches_and_scales_its_learning_rate(tmp_path):
    """48 pairs, batch 4 growing by 4 an epoch up to 12, 3 epochs: 12 + 6 + 4 = 22 steps, each epoch every pair
    once; the learning rate is the schedule's times size / 12."""
    argv = ["--output_dir", str(tmp_path / "out"), "--max_train_samples", "48", *TINY, "--num_train_epochs", "3",
            "--per_device_train_batch_size", "4", "--batch_size_ramp_max", "12", "--eval_strategy", "no",
            "--save_strategy", "no", "--lr_scheduler_type", "constant", "--warmup_steps", "0",
            "--learning_rate", "3e-3"]  # fmt: skip
    trainer = setup_run(argv)
    seen, rates = [], []
    compute_loss = trainer.compute_loss

    def recording(model, inputs, *args, **kwargs):
        seen.append(list(inputs["sample_ids"]))
        rates.append(trainer.optimizer.param_groups[0]["lr"])
        return compute_loss(model, inputs, *args, **kwargs)

    trainer.compute_loss = recording
    trainer.train()
    assert trainer.state.global_step == 22
    assert [len(ids) for ids in seen] == [4] * 12 + [8] * 6 + [12] * 4
    assert rates == pytest.approx([1e-3] * 12 + [2e-3] * 6 + [3e-3] * 4)
    for start, end in ((0, 12), (12, 18), (18, 22)):
        ids = [i for batch in seen[start:end] for i in batch]
        assert len(ids) == len(set(ids)) == 48
    assert trainer.state.epoch == pytest.approx(3.0)


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--gradient_accumulation_steps", "2"], "gradient_accumulation_steps 1"),
        (["--group_by_image", "True"], "no group_by_image"),
        (["--batch_size_ramp_lr", "cubic"], "linear, sqrt or none"),
    ],
)
def test_ramp_flags_are_checked(tmp_path, flags, message):
    from mm_fusion.training import parse_arguments

    argv = ["--output_dir", str(tmp_path), "--per_device_train_batch_size", "4", "--batch_size_ramp_max", "8", *flags]
    with pytest.raises(ValueError, match=message):
        parse_arguments(argv)


def test_auto_batch_size_resumes_with_the_batch_it_agreed_on(tmp_path):
    """A run whose probe found room for 4 pairs (of 16 asked) trains 4 x 4; resumed from a checkpoint it trains 4 x 4
    again without probing, even where 16 would fit now: the checkpoint holds what the ranks agreed on."""
    argv = ["--output_dir", str(tmp_path / "out"), "--max_train_samples", "32", *TINY, "--num_train_epochs", "2",
            "--per_device_train_batch_size", "16", "--auto_find_batch_size", "True", "--eval_strategy", "no",
            "--save_steps", "1", "--group_by_image", "False"]  # fmt: skip
    trainer = setup_run(argv)
    trainer.try_batch_size = lambda size: size <= 4
    trainer.train()
    assert (trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps) == (4, 4)
    assert trainer.state.global_step == 4  # 32 pairs x 2 epochs / 16 a step

    resumed = setup_run([*argv, "--resume_from_checkpoint", str(tmp_path / "out" / "checkpoint-3")])

    def no_probe(size):
        raise AssertionError("a resumed run takes the agreed batch from its checkpoint")

    resumed.try_batch_size = no_probe
    resumed.train(resume_from_checkpoint=resumed.args.resume_from_checkpoint)
    assert (resumed.args.per_device_train_batch_size, resumed.args.gradient_accumulation_steps) == (4, 4)
    assert resumed.state.global_step == 4


@pytest.mark.parametrize("bf16, optim", [(True, "adamw_torch_fused"), (False, "sgd")])
def test_auto_batch_size_probe_runs_as_training_does(tmp_path, monkeypatch, bf16, optim):
    """The memory probe runs before accelerate wraps the model's forward in autocast, yet its activations have the
    run's precision (bfloat16 under --bf16, CPU autocast here; float32 without), and it holds AdamW's two moments per
    trained parameter (none for SGD, whose state it does not know)."""
    argv = ["--output_dir", str(tmp_path / "out"), "--max_train_samples", "16", *TINY, "--bf16", str(bf16),
            "--optim", optim, "--auto_find_batch_size", "True", "--eval_strategy", "no"]  # fmt: skip
    trainer = setup_run(argv)
    trained = {id(p) for p in trainer.model.parameters() if p.requires_grad}
    held, empty_like = [], torch.empty_like
    monkeypatch.setattr(torch, "empty_like", lambda x, **kw: held.append(id(x) in trained) or empty_like(x, **kw))
    dtypes = []
    for module in trainer.model.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_hook(lambda module, args, output: dtypes.append(output.dtype))
    assert trainer.try_batch_size(4)
    assert dtypes and set(dtypes) == {torch.bfloat16 if bf16 else torch.float32}
    assert held.count(True) == (2 * len(trained) if optim == "adamw_torch_fused" else 0)
