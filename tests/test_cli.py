"""What the scripts' command lines do with a mistake, decided without the hub: model paths (`check_model_path`),
mistyped and repeated options (`ScriptArgumentParser`), and the launch command a model card records."""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import huggingface_hub
import pytest

from mm_fusion import check_model_path
from mm_fusion.cli import ScriptArgumentParser
from mm_fusion.training.model_card import launch_command


ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def no_hub(monkeypatch):
    """The hub on (not offline), with every request to it an error: a check that asked it would fail."""

    def refuse(*args, **kwargs):
        raise AssertionError("the hub was asked")

    monkeypatch.setattr(huggingface_hub, "is_offline_mode", lambda: False)
    for name in ("hf_hub_download", "model_info", "try_to_load_from_cache"):
        monkeypatch.setattr(huggingface_hub, name, refuse)


def test_a_model_path_that_names_nothing_is_refused_offline_and_a_hub_id_is_left_to_the_hub(
    tmp_path, monkeypatch, no_hub
):
    """transformers takes any name that is not a local directory for a repo id: a mistyped `outputs/easy_vqa2` went to
    the hub, 28 s of retries without a network. The check answers at once, and still lets a repo id through."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "outputs" / "easy_vqa").mkdir(parents=True)
    (tmp_path / "outputs" / "easy_vqa" / "config.json").write_text("{}")
    (tmp_path / "notes.txt").write_text("")
    check_model_path("outputs/easy_vqa")
    check_model_path(tmp_path / "outputs" / "easy_vqa")
    check_model_path("google/vit-base-patch16-224")  # a repo id, online: the hub's to answer
    check_model_path("bert-base-uncased")
    refused = {
        "outputs/easy_vqa2": "There is no model directory at outputs/easy_vqa2 (",  # `outputs/` is a local folder
        "./easy_vqa": "There is no model directory at ./easy_vqa",
        str(tmp_path / "outputs" / "easy_vq"): f"Did you mean {tmp_path / 'outputs' / 'easy_vqa'}?",
        "some/missing/dir": "There is no model directory at some/missing/dir",
        "outputs": "outputs is a directory but not a saved model: it has no config.json. The model directories in "
        "it: easy_vqa.",
        "notes.txt": "notes.txt is a file",
    }
    for name, message in refused.items():
        with pytest.raises(FileNotFoundError, match=None) as err:
            check_model_path(name)
        assert message in str(err.value), str(err.value)
    with pytest.raises(FileNotFoundError, match=r"Did you mean outputs/easy_vqa\?"):
        check_model_path("outputs/easy_vqa2")


def test_offline_a_repo_id_outside_the_hub_cache_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(huggingface_hub, "is_offline_mode", lambda: True)
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda repo, name: None)
    with pytest.raises(FileNotFoundError, match="HF_HUB_OFFLINE"):
        check_model_path("someone/some-model")
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda repo, name: f"/cache/{repo}/{name}")
    check_model_path("someone/some-model")  # in the cache: transformers loads it offline


@dataclasses.dataclass
class Options:
    question: str | None = None
    image: str | None = None
    learning_rate: float = 0.1


def test_script_parser_errors_are_one_line_with_a_suggestion(capsys):
    parser = ScriptArgumentParser(Options, prog="script.py")
    (options,) = parser.parse_args_into_dataclasses(["--question", "why?", "--learning_rate", "0.5"])
    assert options == Options(question="why?", learning_rate=0.5)
    cases = [
        (["--learning_rat", "1"], "unrecognized arguments: --learning_rat 1. Did you mean --learning_rate?"),
        (["--learning_r", "1"], "Did you mean --learning_rate?"),  # not taken for an abbreviation
        (["--zzz"], "unrecognized arguments: --zzz. `--help` lists the options."),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit) as exited:
            parser.parse_args_into_dataclasses(argv)
        err = capsys.readouterr().err
        assert exited.value.code == 2 and err.startswith("script.py: error: ") and err.endswith(f"{message}\n"), err
    parser.refuse_repeats(["--question", "a", "--image", "x.png"])
    with pytest.raises(SystemExit):
        parser.refuse_repeats(["--question", "a", "--question=b"], hints={"--question": "use a file"})
    assert capsys.readouterr().err == "script.py: error: --question was given 2 times ('a', 'b'); use a file.\n"


def test_launch_command_is_read_from_the_launcher():
    args = ["--output_dir", "out", "--learning_rate", "1e-3"]
    python = "/venv/bin/python3"
    assert launch_command(args, "scripts/train.py", [python, "/venv/bin/accelerate", "launch", "--config_file",
                                                     "c.yaml", "scripts/train.py", *args]) == (
        "accelerate launch --config_file c.yaml scripts/train.py --output_dir out --learning_rate 1e-3"
    )  # fmt: skip
    assert launch_command(args, "train.py", [python, "/venv/bin/torchrun", "--nproc_per_node", "2", "train.py"]) == (
        "torchrun --nproc_per_node 2 train.py --output_dir out --learning_rate 1e-3"
    )
    assert launch_command([], "t.py", [python, "-m", "torch.distributed.run", "--nnodes=2", "t.py"]) == (
        "python -m torch.distributed.run --nnodes=2 t.py"
    )
    assert launch_command(["--run_name", "a b"], "scripts/train.py", ["bash"]) == (
        "python scripts/train.py --run_name 'a b'"
    )


def test_a_mistyped_flag_under_accelerate_launch_is_one_line(tmp_path):
    """`accelerate launch scripts/train.py --learning_rat 1e-3` ended in the script's traceback (no suggestion), then
    accelerate's own. The script now exits 2 with one `error:` line. accelerate itself raises CalledProcessError for
    any script that exits non-zero, unless launched with `-q`: then the line is all there is."""
    accelerate = str(Path(sys.executable).with_name("accelerate"))
    script = str(ROOT / "scripts" / "train.py")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    expected = "train.py: error: unrecognized arguments: --learning_rat 1e-3. Did you mean --learning_rate?"
    quiet = subprocess.run([accelerate, "launch", "-q", "--num_processes", "1", script, "--learning_rat", "1e-3"],
                           capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)  # fmt: skip
    assert quiet.returncode != 0 and expected in quiet.stderr and "Traceback" not in quiet.stderr, quiet.stderr
    plain = subprocess.run([accelerate, "launch", "--num_processes", "1", script, "--learning_rat", "1e-3"],
                           capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)  # fmt: skip
    assert plain.returncode != 0 and expected in plain.stderr
    assert f'File "{script}"' not in plain.stderr and 'training/arguments.py"' not in plain.stderr  # none of ours
