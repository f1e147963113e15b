"""
Time to accuracy on easy-VQA: the training wall time each contender of `benchmark_training_step.py` takes to reach a
common test accuracy, at equal model size: the model `scripts/train.py` ships by default without its tower's reads of
the question, which the seed loop has no counterpart for (`SAME_MODEL`; 64 px; the ResNet tower and BERT, 2 fusion
layers; the seed loop fuses the ResNet's last map with `nn.MultiheadAttention`), 64 samples per step.

Samples per second are not learning: mm_fusion's image-grouped batches run at many times the baselines' samples/s
but learn less per sample. This runs each contender (`seed`, `run_clip`, `mm_fusion`, each in a fresh process, one
after the other) for at most `--max_steps` optimizer steps (the learning-rate schedule of each contender is set for
that many) and evaluates it every `--eval_every` steps on the first `--eval_questions` test questions, through its own
data path (Trainer's evaluation loop for `run_clip` and `mm_fusion`). The clock counts training only: start-up (data
preparation, model) is reported apart and evaluations are left out. A contender stops at the first evaluation at or
above `--target` accuracy, or at the first one after its `--budget_s` seconds of training.
Target: mm_fusion reaches each accuracy in <= 1/3 of the time of the faster baseline that reaches it.

    python scripts/benchmarks/benchmark_time_to_accuracy.py  # ~40 min on 2 cores

Writes scripts/benchmarks/results/benchmark_time_to_accuracy.{json,md} and prints the Markdown table.
"""

import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from baselines import (
    CONTENDERS,
    SEED_MAX_LENGTH,
    SEED_MICRO_BATCH,
    build_fusion_config,
    easy_vqa_splits,
    recipe,
    run_clip_arguments,
    run_clip_dataset,
    seed_model,
    seed_split_loader,
)
from benchmarking import RESULTS, machine, markdown_table, run_in_new_interpreter, write_report
from transformers import HfArgumentParser, TrainerCallback


TARGET_RATIO = 1 / 3  # mm_fusion's time to the common accuracy, as a fraction of the faster baseline's
# scripts/train.py's default model as it was before its ResNet's stages read the question (the seed loop's model has
# no such reads): the same model, within 2% of the parameters, for all three contenders.
SAME_MODEL = "vision_text_attention=false,fusion_init=normal,feature_map_bridge=true"


@dataclass
class TimeToAccuracyArguments:
    contenders: list[str] = field(default_factory=lambda: list(CONTENDERS), metadata={"help": "Contenders to run."})
    target: float = field(default=0.95, metadata={"help": "The test accuracy at which a contender stops."})
    report_at: list[float] = field(
        default_factory=lambda: [0.8, 0.85, 0.9],
        metadata={"help": "Lower accuracies whose times the table gives too."},
    )
    budget_s: list[float] = field(
        default_factory=lambda: [600.0, 1200.0, 600.0],
        metadata={
            "help": "Seconds of training after which a contender stops: one value, or one per contender (default: "
            "600 for seed, 1200 for run_clip, 600 for mm_fusion)."
        },
    )
    max_steps: int = field(
        default=3600, metadata={"help": "Optimizer steps each schedule is set for (3,600 of 64: about 6 epochs)."}
    )
    eval_every: int = field(default=100, metadata={"help": "Optimizer steps between evaluations."})
    eval_questions: int = field(default=1000, metadata={"help": "The first N easy-VQA test questions evaluate."})
    image_size: int = field(default=64, metadata={"help": "Image size of every contender."})
    output: str = field(
        default=str(RESULTS / "benchmark_time_to_accuracy"), metadata={"help": "Writes OUTPUT.json and OUTPUT.md."}
    )


class TrainingClock(TrainerCallback):
    """
    Seconds of training (evaluations left out), each evaluation's accuracy at the training time it was reached, and
    the stop: at the first evaluation at or above `target`, or at the first one after `budget_s`. For a hand-written
    loop, call `step_end()` after each optimizer step and `evaluated(step, accuracy)` after each evaluation.
    """

    def __init__(self, target: float, budget_s: float, eval_every: int, began: float):
        self.target, self.budget_s, self.eval_every, self.began = target, budget_s, eval_every, began
        self.train_s, self.curve, self.stop, self.startup_s = 0.0, [], False, None
        self._resumed = None

    def start(self):
        """Training begins: the time since `began` (the process's start) is start-up."""
        self._resumed = time.perf_counter()
        self.startup_s = self._resumed - self.began

    def step_end(self, step: int) -> bool:
        """Add the step's time; True when an evaluation is due (every `eval_every` steps, or past the budget)."""
        now = time.perf_counter()
        self.train_s += now - self._resumed
        self._resumed = now
        return step % self.eval_every == 0 or self.train_s >= self.budget_s

    def evaluated(self, step: int, accuracy: float):
        self.curve.append({"step": step, "train_s": round(self.train_s, 2), "accuracy": round(accuracy, 4)})
        print(f"  step {step}: accuracy {accuracy:.4f} after {self.train_s:.1f} s of training", flush=True)
        self.stop = accuracy >= self.target or self.train_s >= self.budget_s
        self._resumed = time.perf_counter()  # the evaluation's time is not training time

    # Trainer's hooks: Trainer runs the evaluations (eval_strategy="steps"); a due one past the budget is forced.
    def on_train_begin(self, args, state, control, **kwargs):
        self.start()

    def on_step_end(self, args, state, control, **kwargs):
        if self.step_end(state.global_step):
            control.should_evaluate = True

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.evaluated(state.global_step, metrics["eval_accuracy"])
        if self.stop:  # never unset: Trainer's own flow sets it at max_steps
            control.should_training_stop = True


def train_seed(payload, rec, tokenizer, clock: TrainingClock) -> dict:
    """The seed-style loop of benchmark_training_step (fixed learning rate, manual accumulation), evaluated by hand."""
    size, labels = payload["image_size"], payload["labels"]
    config = build_fusion_config(size, len(tokenizer), SEED_MAX_LENGTH, labels, None, default_tower(), SAME_MODEL)
    model = seed_model(config)
    train, test = easy_vqa_splits(payload["eval_questions"])

    def evaluate() -> float:
        model.eval()
        correct = count = 0
        with torch.no_grad():
            for batch in seed_split_loader(test, tokenizer, size):
                logits = model(batch["pixel_values"], batch["input_ids"], batch["attention_mask"])[1]
                correct += int((logits.argmax(-1) == batch["labels"]).sum())
                count += batch["labels"].shape[0]
        model.train()
        return correct / count

    optimizer = torch.optim.AdamW(model.parameters(), lr=rec["learning_rate"], weight_decay=rec["weight_decay"])
    accumulation, step = rec["batch_size"] // SEED_MICRO_BATCH, 0
    batches = iter(())
    model.train()
    clock.start()
    while step < payload["max_steps"] and not clock.stop:
        for _ in range(accumulation):
            batch = next(batches, None)
            if batch is None:  # a new epoch
                batches = iter(seed_split_loader(train, tokenizer, size))
                batch = next(batches)
            loss = model(**batch)[0] / accumulation
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if clock.step_end(step) or step == payload["max_steps"]:
            clock.evaluated(step, evaluate())
    return {"parameters": sum(p.numel() for p in model.parameters())}


def train_run_clip(payload, rec, tokenizer, clock: TrainingClock) -> dict:
    """transformers' run_clip data path and the stock Trainer, training mm_fusion's model (as in
    benchmark_training_step), evaluated by Trainer's evaluation loop."""
    from transformers import Trainer

    from mm_fusion import MMFusionForImageTextClassification

    size, labels = payload["image_size"], payload["labels"]
    train, test = easy_vqa_splits(payload["eval_questions"])
    (train_dataset, collate), (test_dataset, _) = (run_clip_dataset(s, tokenizer, size, rec) for s in (train, test))

    def accuracy(prediction) -> dict:
        logits = prediction.predictions[0] if isinstance(prediction.predictions, tuple) else prediction.predictions
        return {"accuracy": float((np.asarray(logits).argmax(-1) == np.asarray(prediction.label_ids)).mean())}

    config = build_fusion_config(size, len(tokenizer), rec["max_length"], labels, None, default_tower(), SAME_MODEL)
    config.problem_type = "single_label_classification"
    model = MMFusionForImageTextClassification(config)
    args = run_clip_arguments(
        rec, payload["out"], payload["max_steps"], eval_strategy="steps", eval_steps=payload["eval_every"]
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=train_dataset,
        eval_dataset=test_dataset,
        data_collator=collate,
        compute_metrics=accuracy,
        callbacks=[clock],
    )
    trainer.train()
    return {"parameters": sum(p.numel() for p in model.parameters())}


def default_tower() -> str:
    """The vision tower `scripts/train.py` builds by default: every contender trains it."""
    from mm_fusion.training import ModelArguments

    return ModelArguments().vision_tower


def train_mm_fusion(payload, rec, tokenizer, clock: TrainingClock) -> dict:
    """`mm_fusion.training.setup_run` with its defaults and `SAME_MODEL` (the model of the other contenders),
    evaluated by its Trainer."""
    from mm_fusion.training import setup_run

    argv = ["--output_dir", payload["out"], "--image_size", str(payload["image_size"])]
    argv += ["--max_steps", str(payload["max_steps"]), "--tokenizer_name_or_path", payload["tokenizer"]]
    argv += ["--max_eval_samples", str(payload["eval_questions"]), "--eval_strategy", "steps"]
    argv += ["--eval_steps", str(payload["eval_every"]), "--save_strategy", "no", "--report_to", "none"]
    argv += ["--disable_tqdm", "True", "--config_overrides", SAME_MODEL]
    trainer = setup_run(argv)
    trainer.add_callback(clock)
    trainer.train()
    return {"parameters": sum(p.numel() for p in trainer.model.parameters())}


def run_trial(payload: dict) -> dict:
    """One contender, in this fresh process."""
    from transformers import AutoTokenizer, set_seed

    began = time.perf_counter()
    rec = payload["recipe"]
    set_seed(rec["seed"])
    tokenizer = AutoTokenizer.from_pretrained(payload["tokenizer"])
    clock = TrainingClock(payload["target"], payload["budget_s"], payload["eval_every"], began)
    train = {"seed": train_seed, "run_clip": train_run_clip, "mm_fusion": train_mm_fusion}[payload["contender"]]
    result = train(payload, rec, tokenizer, clock)
    reached = first_time(clock.curve, payload["target"])
    return {
        "contender": payload["contender"],
        "torch_threads": torch.get_num_threads(),
        "startup_s": round(clock.startup_s, 2),
        "train_s": round(clock.train_s, 2),
        "time_to_target_s": reached["train_s"] if reached else None,
        "steps_to_target": reached["step"] if reached else None,
        "budget_s": payload["budget_s"],
        "best_accuracy": max(e["accuracy"] for e in clock.curve),
        "curve": clock.curve,
        **result,
    }


def main(argv: list[str] | None = None) -> dict:
    (args,) = HfArgumentParser(TimeToAccuracyArguments).parse_args_into_dataclasses(args=argv)
    unknown = set(args.contenders) - set(CONTENDERS)
    if unknown:
        raise ValueError(f"Unknown contenders {sorted(unknown)}; choose from {list(CONTENDERS)}.")
    import easy_vqa

    from mm_fusion import train_tokenizer

    rec, info, start = recipe(), machine(), time.perf_counter()
    work = tempfile.mkdtemp(prefix="mm_fusion_time_to_accuracy_")
    trials = []
    try:
        tokenizer = train_tokenizer(easy_vqa.get_train_questions()[0], vocab_size=rec["vocab_size"])
        tokenizer_dir = os.path.join(work, "tokenizer")
        tokenizer.save_pretrained(tokenizer_dir)
        if len(args.budget_s) not in (1, len(args.contenders)):
            raise ValueError(f"--budget_s takes one value or one per contender ({args.contenders}): {args.budget_s}")
        budgets = dict(
            zip(args.contenders, args.budget_s * len(args.contenders) if len(args.budget_s) == 1 else args.budget_s)
        )
        for contender in args.contenders:
            print(f"{contender}:", flush=True)
            payload = asdict(args) | {
                "budget_s": budgets[contender],
                "contender": contender,
                "recipe": rec,
                "tokenizer": tokenizer_dir,
                "labels": list(easy_vqa.get_answers()),
                "out": tempfile.mkdtemp(dir=work),
            }
            cache = os.path.join(work, f"datasets_cache_{contender}")  # each prepares its data from scratch
            trials.append(
                run_in_new_interpreter("benchmark_time_to_accuracy:run_trial", payload, datasets_cache=cache)
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)

    table, ratios = markdown(trials, args, info, rec)
    print("\n" + table)
    report = {"arguments": asdict(args), "recipe": rec, "machine": info, "trials": trials, "ratios": ratios}
    report["wall_s"] = time.perf_counter() - start
    write_report(args.output, report, table)
    return report


def first_time(curve: list[dict], accuracy: float) -> dict | None:
    """The first evaluation at or above `accuracy` (its step and seconds of training), if any."""
    return next((e for e in curve if e["accuracy"] >= accuracy), None)


def markdown(trials: list[dict], args, info: dict, rec: dict) -> tuple[str, list[dict]]:
    thresholds = sorted({*args.report_at, args.target})
    budgets = [f"{t['contender']} {t['budget_s']:.0f} s" for t in trials]
    rows = []
    for t in trials:
        cells = []
        for accuracy in thresholds:
            hit = first_time(t["curve"], accuracy)
            cells.append(f"{hit['train_s']:.0f} s ({hit['step']})" if hit else "–")
        last = t["curve"][-1]
        rows.append(
            [t["contender"], f"{t['parameters']:,}", f"{t['startup_s']:.0f} s", *cells,
             f"{t['best_accuracy']:.3f} ({last['step']} steps, {t['train_s']:.0f} s)"]
        )  # fmt: skip
    header = ["contender", "parameters", "start-up", *(f"to {a}" for a in thresholds), "best (trained)"]
    text = (
        f"easy-VQA: seconds of training (optimizer steps) to each test accuracy on the first {args.eval_questions} "
        f"test questions, {args.image_size} px, {rec['batch_size']} samples per optimizer step, schedules set for "
        f"{args.max_steps} steps, an evaluation every {args.eval_every} steps (its time left out), each contender "
        f"stopped at {args.target} or after its budget of training time ({', '.join(budgets)}). {info['cores']} cores "
        f"({info['cpu']}), torch threads {sorted({t['torch_threads'] for t in trials})}, torch {info['torch']}; one "
        "run, the contenders one after the other, alone on the machine.\n\n" + markdown_table(header, rows)
    )
    by_name = {t["contender"]: t for t in trials}
    ratios = []
    for accuracy in thresholds:
        ours = first_time(by_name["mm_fusion"]["curve"], accuracy) if "mm_fusion" in by_name else None
        reached = {
            n: hit["train_s"]
            for n in ("seed", "run_clip")
            if n in by_name and (hit := first_time(by_name[n]["curve"], accuracy)) is not None
        }
        if not reached or "mm_fusion" not in by_name:
            continue
        faster = min(reached, key=reached.get)
        # A baseline reached it and mm_fusion did not (within its budget): a failure, not a row left out.
        ratio = ours["train_s"] / reached[faster] if ours is not None else None
        ratios.append(
            {
                "accuracy": accuracy,
                "faster_baseline": faster,
                "ratio": ratio,
                "pass": ratio is not None and ratio <= TARGET_RATIO,
            }
        )
    if ratios:
        text += "\n\nmm_fusion's time as a fraction of the faster baseline's to reach the same accuracy (target <= "
        text += f"{TARGET_RATIO:.2f}):\n\n" + markdown_table(
            ["accuracy", "faster baseline", "mm_fusion / baseline", ""],
            [
                [
                    r["accuracy"],
                    r["faster_baseline"],
                    "not reached" if r["ratio"] is None else f"{r['ratio']:.2f}",
                    "PASS" if r["pass"] else "FAIL",
                ]
                for r in ratios
            ],
        )
    curves = "\n".join(
        f"- {t['contender']}: " + ", ".join(f"{e['accuracy']:.3f} at {e['train_s']:.0f} s" for e in t["curve"])
        for t in trials
    )
    return text + "\n\nEvaluations (accuracy at seconds of training):\n\n" + curves + "\n", ratios


if __name__ == "__main__":
    main()
