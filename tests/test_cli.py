"""What the scripts' command lines do with a mistake: model paths (`check_model_path`, at once without the hub, and in
one short request to it), mistyped and repeated options (`ScriptArgumentParser`), the console scripts, and the
launch command a model card records."""

import dataclasses
import http.server
import importlib
import inspect
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from unittest import mock

import huggingface_hub
import pytest
from helpers.run_scripts import run_in_one_child

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
    for name in ("hf_hub_download", "model_info", "try_to_load_from_cache", "get_hf_file_metadata"):
        monkeypatch.setattr(huggingface_hub, name, refuse)


def test_a_model_path_that_names_nothing_is_refused_without_the_hub(tmp_path, monkeypatch, no_hub):
    """transformers takes any name that is not a local directory for a repo id: a mistyped `outputs/easy_vqa2` went to
    the hub, 28 s of retries without a network. A name that is meant as a local path is answered at once, without
    asking the hub or its cache (a repo id: test_a_repo_id_is_asked_of_the_hub_once_and_briefly)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "outputs" / "easy_vqa").mkdir(parents=True)
    (tmp_path / "outputs" / "easy_vqa" / "config.json").write_text("{}")
    (tmp_path / "notes.txt").write_text("")
    check_model_path("outputs/easy_vqa")
    check_model_path(tmp_path / "outputs" / "easy_vqa")
    refused = {
        "outputs/easy_vqa2": "There is no model directory at outputs/easy_vqa2 (",  # `outputs/` is a local folder
        "./easy_vqa": "There is no model directory at ./easy_vqa",
        str(tmp_path / "outputs" / "easy_vq"): f"Did you mean {tmp_path / 'outputs' / 'easy_vqa'}?",
        "some/missing/dir": "There is no model directory at some/missing/dir",
        "outputs": "outputs is a directory but not a saved model: it has no config.json. The model directories in "
        "it: easy_vqa.",
        "notes.txt": "notes.txt is a file",
        "~/no/such/model": "There is no model directory at ~/no/such/model",
        "outputs/easy vqa": "There is no model directory at outputs/easy vqa",  # not a valid repo id
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


class _FakeHub(http.server.BaseHTTPRequestHandler):
    """The hub's answers to `HEAD /<repo>/resolve/main/config.json`, by repo; every request is counted."""

    asked: list[str] = []
    answers = {
        "someone/model": (200, {"ETag": '"abc"', "X-Repo-Commit": "0" * 40, "Content-Length": "2"}),
        "someone/no-config": (404, {"X-Error-Code": "EntryNotFound"}),
        "someone/gated": (401, {"X-Error-Code": "GatedRepo"}),
        "someone/broken": (500, {}),
    }

    def do_HEAD(self):
        repo = self.path.split("/resolve/")[0].strip("/")
        type(self).asked.append(repo)
        status, headers = self.answers.get(repo, (404, {"X-Error-Code": "RepoNotFound"}))
        self.send_response(status)
        for key, value in {"Content-Length": "0", **headers}.items():
            self.send_header(key, value)
        self.end_headers()

    def log_message(self, *args):
        pass


def _closed_port() -> socket.socket:
    """A socket bound to a local port and not listening: connecting to it is refused while it is open."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock


@pytest.fixture
def hub_at(monkeypatch, tmp_path):
    """Point the hub client at `endpoint` (online, with an empty cache) for the rest of the test."""

    def point(endpoint: str) -> None:
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", endpoint)
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))

    monkeypatch.chdir(tmp_path)
    return point


def test_a_repo_id_is_asked_of_the_hub_once_and_briefly(hub_at, monkeypatch):
    """A name that can be a repo id and is not in the hub cache: one request for its config.json, no retries. A model
    the hub has passes, and so does an answer that is transformers' to explain (gated, a server error); a repo the hub
    lacks, one without config.json, a hub that refuses the connection or does not answer are one line at once."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _FakeHub.asked = []
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    hub_at(endpoint)
    try:
        for name in ("someone/model", "someone/gated", "someone/broken"):
            check_model_path(name)
        refused = {
            "someone/missing": f"Nor does the hub ({endpoint}) have a model of that name",
            "easy_vqa": f"There is no model directory at easy_vqa ({Path.cwd() / 'easy_vqa'}). Nor does the hub",
            "someone/no-config": "The hub's repo of that name (http://127.0.0.1:",
        }
        for name, message in refused.items():
            with pytest.raises(FileNotFoundError) as err:
                check_model_path(name)
            assert message in str(err.value) and "\n" not in str(err.value), str(err.value)
        assert sorted(_FakeHub.asked) == sorted(["someone/model", "someone/gated", "someone/broken", *refused])
    finally:
        server.shutdown()
        server.server_close()

    with _closed_port() as closed:
        hub_at(f"http://127.0.0.1:{closed.getsockname()[1]}")
        with pytest.raises(FileNotFoundError, match="cannot be reached: .*refused"):
            check_model_path("someone/model")
    with socket.socket() as silent:  # listening, never answering
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        hub_at(f"http://127.0.0.1:{silent.getsockname()[1]}")
        monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", "0.5")
        start = time.monotonic()
        with pytest.raises(FileNotFoundError, match=r"cannot be reached: no answer within 0.5 s\.$"):
            check_model_path("someone/model")
        assert time.monotonic() - start < 5


MISSING = "outputs/no-such-model"  # a valid repo id, and `outputs/` does not exist: only the hub could answer
ENTRY_POINTS = {  # the command line, and its exit status for a missing model
    "predict": (["scripts/predict.py", "--model", MISSING, "--image", "shape.png", "--question", "what?"], 2),
    "demo": (["scripts/demo.py", MISSING], 1),
    "visualize_attention": (
        ["scripts/visualize_attention.py", "--model", MISSING, "--image", "shape.png", "--question", "what?"],
        2,
    ),
    "export": (["-m", "mm_fusion.export", MISSING, "onnx"], 1),
}


def test_a_model_neither_local_nor_reachable_on_the_hub_is_one_line_at_once(tmp_path):
    """With the hub unreachable and HF_HUB_OFFLINE unset, `--model outputs/no-such-model` is one line naming it, as
    soon as the command has imported its libraries (about 0.1 s after them; the bound is loose for a busy machine):
    no retries against the hub, no traceback. The command lines run in one child interpreter
    (tests/helpers/run_scripts.py), each as `python SCRIPT` (`python -m MODULE`) runs it."""
    runs = [{"argv": [str(ROOT / a) if a.startswith("scripts/") else a for a in argv], "cwd": tmp_path}
            for argv, _ in ENTRY_POINTS.values()]  # fmt: skip
    (tmp_path / "shape.png").write_bytes(b"")
    offline = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    env = {key: value for key, value in os.environ.items() if key not in offline}
    with _closed_port() as hub:
        env.update(
            HF_ENDPOINT=f"http://127.0.0.1:{hub.getsockname()[1]}",  # nothing leaves the machine
            HF_HUB_CACHE=str(tmp_path / "hub-cache"),
            PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        )
        results = run_in_one_child(runs, tmp_path, env=env, timeout=300)
    for (entry_point, (_, status)), result in zip(ENTRY_POINTS.items(), results):
        lines = result.stderr.strip().splitlines()
        assert result.returncode == status and len(lines) == 1, (entry_point, result.stderr[-3000:])
        assert "Traceback" not in result.stderr, (entry_point, result.stderr[-3000:])
        assert f"There is no model directory at {MISSING} (" in lines[0] and "cannot be reached" in lines[0], lines
        assert result.seconds < 20, (entry_point, f"{result.seconds:.1f} s")


CONSOLE_SCRIPTS = {
    "mm_fusion.export": "mm-fusion-export",
    "mm_fusion.lora": "mm-fusion-merge-lora",
    "mm_fusion.convert_mobilenet_v2": "mm-fusion-convert-mobilenet-v2",
    "mm_fusion.training.slurm": "mm-fusion-slurm-flags",
}


def test_console_scripts_run_the_python_m_commands(monkeypatch, capsys):
    """Each `python -m mm_fusion.*` command is a console script of pyproject.toml, run as its wrapper runs it
    (`sys.exit(main())`): `--help` exits 0 with a usage line under the script's name, and, for those with required
    arguments, leaving them out is one `error:` line naming them, exit status 2."""
    tomllib = pytest.importorskip("tomllib")
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert {target.split(":")[0]: name for name, target in scripts.items()} == CONSOLE_SCRIPTS
    for name, target in scripts.items():
        module, function = target.split(":")
        main = getattr(importlib.import_module(module), function)
        assert list(inspect.signature(main).parameters) == ["argv"], target
        assert inspect.signature(main).parameters["argv"].default is None, target
        monkeypatch.setattr(sys, "argv", [f"/venv/bin/{name}", "--help"])
        with pytest.raises(SystemExit) as exited:
            sys.exit(main())
        out = capsys.readouterr().out
        assert exited.value.code == 0 and out.startswith(f"usage: {name} "), out
        installed = Path(sys.executable).with_name(name)
        if installed.is_file():  # an environment installed with this pyproject.toml: the wrapper pip wrote
            assert f"from {module} import {function}" in installed.read_text(), installed
            if name == "mm-fusion-export":  # one wrapper run as a user runs it (each start costs ~7 s on 2 cores)
                done = subprocess.run([str(installed), "--help"], capture_output=True, text=True, timeout=120)
                assert done.returncode == 0 and done.stdout.startswith(f"usage: {name} "), done.stderr[-2000:]
        if module == "mm_fusion.training.slurm":  # no required arguments; its errors: tests/test_slurm.py
            continue
        monkeypatch.setattr(sys, "argv", [f"/venv/bin/{name}"])
        with pytest.raises(SystemExit) as exited:
            sys.exit(main())
        err = capsys.readouterr().err
        assert exited.value.code == 2 and err.count("\n") == 1, err
        assert err.startswith(f"{name}: error: the following arguments are required: "), err


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
    """`accelerate launch -q scripts/train.py --learning_rat 1e-3`: the script exits non-zero with one `error:` line
    that suggests the flag meant, and no traceback (accelerate itself adds its own CalledProcessError traceback
    when launched without `-q`, for any script that exits non-zero)."""
    accelerate = str(Path(sys.executable).with_name("accelerate"))
    script = str(ROOT / "scripts" / "train.py")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    expected = "train.py: error: unrecognized arguments: --learning_rat 1e-3. Did you mean --learning_rate?"
    quiet = subprocess.run([accelerate, "launch", "-q", "--num_processes", "1", script, "--learning_rat", "1e-3"],
                           capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)  # fmt: skip
    assert quiet.returncode != 0 and expected in quiet.stderr and "Traceback" not in quiet.stderr, quiet.stderr
    assert [line for line in quiet.stderr.splitlines() if "error" in line.lower()] == [expected], quiet.stderr


@pytest.mark.parametrize(
    "override, message",
    [
        ("fusion_layerz=2", "'fusion_layerz' is not an MMFusionConfig setting; did you mean 'num_fusion_layers'?"),
        ("num_fusion_layers=two", "Field 'num_fusion_layers' expected int, got str"),
        ("fusion_type=lat", "Unknown fusion_type 'lat'"),
    ],
)
def test_a_wrong_config_override_is_one_line_before_any_data_is_read(tmp_path, capsys, override, message):
    """`--config_overrides` is checked with the other arguments, before any data is read or tokenizer trained: a
    mistyped key or a wrong value is exit status 2, one `error:` line naming the key or value, and no output
    directory made. The script runs as a user runs it for the first case (the others: its `main`, in this
    process)."""
    script = ROOT / "scripts" / "train.py"
    out = tmp_path / "out"
    argv = ["--output_dir", str(out), "--config_overrides", override]
    if override.startswith("fusion_layerz"):
        started = time.perf_counter()
        done = subprocess.run([sys.executable, str(script), *argv], capture_output=True, text=True, cwd=tmp_path,
                              timeout=300)  # fmt: skip
        seconds = time.perf_counter() - started
        status, err = done.returncode, done.stderr
        assert seconds < 60, seconds  # the interpreter's imports only (a loose bound: the machines are shared)
    else:
        spec = importlib.util.spec_from_file_location("train_script", script)
        train_script = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(train_script)
        with pytest.raises(SystemExit) as exited, mock.patch.object(sys, "argv", [str(script)]):  # its prog
            train_script.main(argv)
        status, err = exited.value.code, capsys.readouterr().err
    lines = err.strip().splitlines()
    assert status == 2 and len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert lines[0].startswith("train.py: error: --config_overrides") and message in lines[0], lines
    assert not out.exists()


def test_config_overrides_that_fit_pass_the_check_and_a_checkpoint_refuses_them(tmp_path):
    from mm_fusion.training import parse_arguments

    shipped = 'vision_bridge_layers=[3],text_bridge_layers=["words"],fusion_layer_order=cross_first,fusion_init=normal'
    model_args = parse_arguments(["--output_dir", str(tmp_path), "--config_overrides", shipped])[0]
    assert model_args.config_overrides == shipped
    with pytest.raises(ValueError, match="--model_name_or_path .* brings its own: drop --config_overrides"):
        parse_arguments(["--output_dir", str(tmp_path), "--model_name_or_path", str(tmp_path), "--config_overrides",
                         "projection_dim=64"])  # fmt: skip
