"""
Benchmark onnxruntime against PyTorch on this CPU for the exported graphs (`python -m mm_fusion.export`) of the
README default model's architecture (`scripts/train.py` with no arguments: ResNet tower, hierarchical fusion, 64 px
images, easy-VQA's 13 answers) and of its `--task pretrain` counterpart: VQA logits, and the image and text
embeddings. Untrained weights: the speed does not depend on them, and the export is checked against PyTorch as it is
written.

For each graph and batch size (1 and 64 by default) it times `--repeats` rounds of `--calls` calls after a warm-up,
PyTorch under `torch.inference_mode()` and onnxruntime's CPU provider, both with the same number of threads, in one
process, alternating: the ratio is measured in one run on the same machine.

    python scripts/benchmarks/benchmark_onnx.py                        # about 3 minutes on 2 cores
    python scripts/benchmarks/benchmark_onnx.py --repeats 1 --calls 2  # a look

Writes scripts/benchmarks/results/onnx_inference.{json,md} and prints the Markdown table.
"""

import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import onnxruntime
import torch
from benchmarking import RESULTS, machine, markdown_table, median_range, spread, write_report
from transformers import HfArgumentParser

from mm_fusion import MMFusionImageProcessor, MMFusionProcessor, train_tokenizer
from mm_fusion.export import GRAPH_MODULES, export_model, graphs_for, run_graph
from mm_fusion.export import example_inputs as graph_inputs
from mm_fusion.training.arguments import DataArguments, ModelArguments
from mm_fusion.training.models import build_config, model_class


EASY_VQA_ANSWERS = 13
QUESTION_TOKENS = 12  # a typical easy-VQA question with its [CLS] / [SEP]


@dataclass
class Options:
    batch_sizes: str = "1,64"
    repeats: int = 5  # timed rounds per graph, batch size and runtime
    calls: int = 10  # calls per round
    threads: int = 0  # 0: torch's default (the cores); onnxruntime gets the same
    output: str = str(RESULTS / "onnx_inference")


def save_default_model(directory: Path, task: str) -> None:
    """The default run's model (untrained) and a processor whose tokenizer fits its vocabulary."""
    model_args, data_args = ModelArguments(task=task), DataArguments()
    tokenizer = train_tokenizer(["what shape is in the image", "what color is the shape"], vocab_size=200)
    image_size = data_args.image_size or 64
    labels = [f"answer {i}" for i in range(EASY_VQA_ANSWERS)] if task != "pretrain" else None
    config = build_config(model_args, image_size, len(tokenizer), data_args.max_length, labels)
    torch.manual_seed(0)
    model_class(task)(config).save_pretrained(directory)
    processor = MMFusionProcessor(MMFusionImageProcessor(size={"height": image_size, "width": image_size}), tokenizer)
    processor.save_pretrained(directory)


def time_calls(call, calls: int) -> float:
    """Milliseconds per call over `calls` calls."""
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) * 1000 / calls


def measure(model, session, graph, batch: int, options: Options) -> dict:
    inputs = graph_inputs(model, model.config.vision_config.image_size or 64, batch=batch, length=QUESTION_TOKENS)
    module = GRAPH_MODULES[graph.name](model).eval()
    args = tuple(inputs[name] for name in graph.inputs)

    def pytorch():
        with torch.inference_mode():
            module(*args)

    def onnx():
        run_graph(session, graph, inputs)

    for call in (pytorch, onnx):  # warm-up
        time_calls(call, 2)
    times = {"pytorch": [], "onnxruntime": []}
    for _ in range(options.repeats):  # alternating, so that a slow spell of the machine hits both
        times["pytorch"].append(time_calls(pytorch, options.calls))
        times["onnxruntime"].append(time_calls(onnx, options.calls))
    result = {"graph": graph.name, "batch_size": batch}
    for runtime, values in times.items():
        result[f"{runtime}_ms_per_call"] = spread(values)
        result[f"{runtime}_samples_per_second"] = spread([batch * 1000 / v for v in values])
    result["speedup"] = statistics.median(times["pytorch"]) / statistics.median(times["onnxruntime"])
    return result


def main() -> None:
    (options,) = HfArgumentParser(Options).parse_args_into_dataclasses()
    if options.threads:
        torch.set_num_threads(options.threads)
    threads = torch.get_num_threads()
    session_options = onnxruntime.SessionOptions()
    session_options.intra_op_num_threads = threads
    batch_sizes = [int(b) for b in options.batch_sizes.split(",")]
    results, table = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for task in ("vqa", "pretrain"):
            saved, exported = Path(tmp) / task, Path(tmp) / f"{task}_onnx"
            save_default_model(saved, task)
            manifest = export_model(saved, exported)
            model = model_class(task).from_pretrained(saved).eval()
            for graph in graphs_for(model):
                if graph.name == "matching":
                    continue  # the same fusion as the VQA graph, with a two-way head
                path = str(exported / graph.file)
                session = onnxruntime.InferenceSession(path, session_options, providers=["CPUExecutionProvider"])
                for batch in batch_sizes:
                    result = {
                        "task": task,
                        **measure(model, session, graph, batch, options),
                        "max_abs_difference": manifest["graphs"][graph.name]["max_abs_difference"],
                    }
                    results.append(result)
                    table.append([
                        task, graph.file, batch, median_range(result["pytorch_ms_per_call"], 2),
                        median_range(result["onnxruntime_ms_per_call"], 2), f"{result['speedup']:.2f}x",
                        f"{result['max_abs_difference']:.1e}",
                    ])  # fmt: skip
                    print(table[-1], flush=True)
    header = ["model", "graph", "batch", "PyTorch ms / call", "onnxruntime ms / call", "onnxruntime speed-up",
              "max abs difference (export check)"]  # fmt: skip
    text = markdown_table(header, table)
    report = {"machine": machine(), "threads": threads, "options": vars(options), "results": results}
    title = "# onnxruntime against PyTorch on CPU: the README default model's exported graphs"
    write_report(options.output, report, title + "\n\n" + text)
    print(text)


if __name__ == "__main__":
    main()
