"""A model name checked before transformers takes what is not a local directory for a hub repo id: at once offline, and
with one short request to the hub otherwise."""

import difflib
import os
from pathlib import Path


CONFIG_NAME = "config.json"
# Seconds the hub has to answer whether it holds a model that is not local (`HF_HUB_ETAG_TIMEOUT` when set).
HUB_TIMEOUT = 3.0


def check_model_path(name_or_path: str | os.PathLike) -> None:
    """
    Raise `FileNotFoundError` at once, with one line naming `name_or_path`, when it is not a model transformers can
    load: a local model directory, a model in the hub cache, or one the hub holds.

    transformers reads any name that is not a local directory as a hub repo id, so a mistyped `outputs/easy_vqa2`
    is asked of the hub (retried for about half a minute when the hub cannot be reached) and ends in a long
    traceback about connecting to it. A name is taken for a local path, and refused here without a network, when:

    - it exists but is a file, or a directory without `config.json` (the error lists the models inside it);
    - it cannot be a repo id: absolute, starting with `.` or `~`, with a backslash or more than one `/`, or not a
      valid repo id;
    - its first part is a local directory (`outputs/easy_vqa2` where `outputs/` exists).

    A name that can be a repo id passes when the hub cache holds its `config.json` (transformers loads it from there
    even when the hub cannot be reached). Otherwise it is refused when the hub is off (`HF_HUB_OFFLINE=1`), and else
    the hub is asked once, without retries and within `HUB_TIMEOUT` seconds (`HF_HUB_ETAG_TIMEOUT` when set), for the
    model's `config.json`: the name is refused when the hub cannot be reached, has no repo of that name (or none this
    login may see), or the repo has no `config.json`. Any other answer (the file, a gated repo, a server error) is
    left to transformers to load or to explain.
    """
    text = os.fspath(name_or_path)
    path = Path(text).expanduser()
    if path.is_dir():
        if (path / CONFIG_NAME).is_file():
            return
        inside = _model_dirs(path)
        listed = f" The model directories in it: {', '.join(inside)}." if inside else ""
        raise FileNotFoundError(f"{text} is a directory but not a saved model: it has no {CONFIG_NAME}.{listed}")
    if path.exists():
        raise FileNotFoundError(f"{text} is a file; pass the directory a model was saved to (with {CONFIG_NAME}).")
    problem = ""
    if _may_be_hub_id(text):
        from huggingface_hub import is_offline_mode, try_to_load_from_cache

        if isinstance(try_to_load_from_cache(text, CONFIG_NAME), str):
            return
        if is_offline_mode():
            problem = " The hub is off (HF_HUB_OFFLINE) and its cache has no model of that name either."
        else:
            problem = _hub_problem(text)
            if problem is None:
                return
    raise FileNotFoundError(f"There is no model directory at {text} ({path.absolute()}).{problem}{_suggestion(path)}")


def _hub_problem(repo_id: str) -> str | None:
    """Why the hub cannot give `repo_id`'s `config.json`, as a sentence (with a leading space); None when it can, or
    when its answer is for transformers to explain. One request, no retries, within [`HUB_TIMEOUT`] seconds."""
    from huggingface_hub import constants, get_hf_file_metadata
    from huggingface_hub.errors import EntryNotFoundError, GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    endpoint = constants.ENDPOINT
    timeout = float(os.environ.get("HF_HUB_ETAG_TIMEOUT") or HUB_TIMEOUT)
    url = f"{endpoint}/{repo_id}/resolve/{constants.DEFAULT_REVISION}/{CONFIG_NAME}"
    try:
        get_hf_file_metadata(url, timeout=timeout)
    except GatedRepoError:  # a subclass of RepositoryNotFoundError: transformers says how to ask for access
        return None
    except RepositoryNotFoundError:
        return f" Nor does the hub ({endpoint}) have a model of that name (or it is private to another account)."
    except EntryNotFoundError:
        return f" The hub's repo of that name ({endpoint}) has no {CONFIG_NAME}: it is not a saved model."
    except HfHubHTTPError:
        return None
    except Exception as err:
        if not _unreachable(err):
            raise
        reason = f"no answer within {timeout:g} s" if "Timeout" in type(err).__name__ else _one_line(err)
        return f" As a hub repo id it is not in the hub cache, and the hub ({endpoint}) cannot be reached: {reason}."
    return None


def _unreachable(err: Exception) -> bool:
    """Whether a request raised `err` without an answer from the server: a connection, timeout or proxy error of the
    HTTP library the hub client uses (httpx, or httpx2 in later versions), or an `OSError`."""
    library = type(err).__module__.partition(".")[0]
    return isinstance(err, OSError) or library in ("httpx", "httpx2", "httpcore", "requests", "urllib3")


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


def _may_be_hub_id(text: str) -> bool:
    """Whether `text` can be a hub repo id that is not meant as a local path."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if os.path.isabs(text) or text.startswith((".", "~")) or "\\" in text or text.count("/") > 1:
        return False
    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return not ("/" in text and Path(text.split("/")[0]).is_dir())


def _model_dirs(directory: Path) -> list[str]:
    """The saved models directly inside `directory`, by name."""
    try:
        return sorted(p.name for p in directory.iterdir() if (p / CONFIG_NAME).is_file())
    except OSError:
        return []


def _suggestion(path: Path) -> str:
    """` Did you mean ...?` from the models beside where `path` points, or what its nearest existing folder holds."""
    parent = path.parent
    while not parent.is_dir() and parent != parent.parent:
        parent = parent.parent
    models = _model_dirs(parent)
    if not models:
        return ""
    if parent == path.parent:
        close = difflib.get_close_matches(path.name, models, n=1)
        if close:
            return f" Did you mean {path.parent / close[0]}?"
    return f" The model directories in {parent}: {', '.join(models)}."


__all__ = ["check_model_path"]
