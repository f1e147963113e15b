"""A model name checked offline, before transformers takes what is not a local directory for a hub repo id."""

import difflib
import os
from pathlib import Path


CONFIG_NAME = "config.json"


def check_model_path(name_or_path: str | os.PathLike) -> None:
    """
    Raise `FileNotFoundError` at once when `name_or_path` is meant as a local model directory and is not one.

    transformers reads any name that is not a local directory as a hub repo id, so a mistyped `outputs/easy_vqa2`
    is asked of the hub (retried for about half a minute without a network) and ends in a long traceback about
    connecting to it. A name is taken for a local path, and refused here without a network, when:

    - it exists but is a file, or a directory without `config.json` (the error lists the models inside it);
    - it cannot be a repo id: absolute, starting with `.` or `~`, with a backslash or more than one `/`;
    - its first part is a local directory (`outputs/easy_vqa2` where `outputs/` exists);
    - the hub is off (`HF_HUB_OFFLINE=1`) and the hub cache holds no model of that name.

    Anything else (`google/vit-base-patch16-224` online) is left to transformers and the hub.
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
    from huggingface_hub import is_offline_mode, try_to_load_from_cache

    offline = ""
    if _may_be_hub_id(text):
        if not is_offline_mode():
            return
        if isinstance(try_to_load_from_cache(text, CONFIG_NAME), str):
            return
        offline = " The hub is off (HF_HUB_OFFLINE) and its cache has no model of that name either."
    raise FileNotFoundError(f"There is no model directory at {text} ({path.absolute()}).{offline}{_suggestion(path)}")


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
