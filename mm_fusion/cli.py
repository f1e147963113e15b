"""
The argument parser of the scripts and of the `python -m mm_fusion.*` commands (also console scripts, `mm-fusion-*`):
a mistyped or repeated option, a missing argument or a failure is a one-line `error:` that names it.

The commands follow one pattern (`mm_fusion/export.py`, `lora.py`, `convert_mobilenet_v2.py`):

    @dataclass
    class ExportArguments:
        model_dir: str = field(metadata={"positional": True, "help": "..."})
        atol: float = field(default=1e-4, metadata={"help": "..."})

    def main(argv: list[str] | None = None) -> int:
        parser = ScriptArgumentParser(ExportArguments, prog=command_name("mm_fusion.export"), description="...")
        (args,) = parser.parse_command_line(argv)
        try:
            ...
        except (FileNotFoundError, ValueError, ImportError) as error:
            parser.fail(error)  # one line, exit status 1
        return 0

    if __name__ == "__main__":
        sys.exit(main())

Usage errors exit with status 2, as argparse's; a failure of the command itself with status 1; success returns 0.
"""

import dataclasses
import difflib
import json
import os
import re
import sys

from transformers import HfArgumentParser


class ScriptArgumentParser(HfArgumentParser):
    """
    `HfArgumentParser` whose errors are one line on stderr and exit status 2, as argparse's own, with no traceback:

    - an unknown option suggests the closest one (`--learning_rat`: did you mean `--learning_rate`?), where
      `HfArgumentParser` raised a `ValueError`;
    - abbreviations are refused (`--learning_rat` is not taken for `--learning_rate`);
    - the error does not print the usage line, which for the training arguments runs to hundreds of lines;
    - [`refuse_repeats`] makes an option given twice an error, where argparse keeps the last silently.

    Unknown arguments are an error even through `parse_known_args` (which `HfArgumentParser` parses with), so nothing
    is left over for `return_remaining_strings`.

    A dataclass field with `metadata={"positional": True}` is a positional argument (`MODEL_DIR OUT_DIR`), which
    `HfArgumentParser` has no way to declare (every field is an `--option`); optional when the field has a default.
    """

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    @staticmethod
    def _parse_dataclass_field(parser, field: dataclasses.Field):
        if not field.metadata.get("positional"):
            return HfArgumentParser._parse_dataclass_field(parser, field)
        kwargs = {key: value for key, value in field.metadata.items() if key != "positional"}
        if field.default is not dataclasses.MISSING:
            kwargs.update(nargs="?", default=field.default)
        parser.add_argument(field.name, type=field.type, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")

    def fail(self, error: BaseException | str, status: int = 1):
        """Exit with `status` and one line `PROG: error: ...` for a failure of the command itself (not of its
        command line): a missing model, weights that do not fit, a package to install."""
        self.exit(status, f"{self.prog}: error: {' '.join(str(error).split()) or type(error).__name__}\n")

    def parse_command_line(self, argv: list[str] | None = None) -> tuple:
        """The dataclasses of the command line `argv` (default: `sys.argv[1:]`), each option given once."""
        argv = sys.argv[1:] if argv is None else list(argv)
        self.refuse_repeats(argv)
        return self.parse_args_into_dataclasses(args=argv)

    def parse_known_args(self, args=None, namespace=None):
        namespace, remaining = super().parse_known_args(args, namespace)
        if remaining:
            self.error(self.unknown_options_message(remaining))
        return namespace, remaining

    def unknown_options_message(self, remaining: list[str]) -> str:
        """What is wrong with arguments no option took, and the closest options to the mistyped ones."""
        known = [option for option in self._option_string_actions if option.startswith("--")]
        unknown = [word.split("=", 1)[0] for word in remaining if word.startswith("-")]
        close = {option: difflib.get_close_matches(option, known, n=1) for option in unknown}
        suggestions = [f"{match[0]} for {option}" for option, match in close.items() if match]
        message = f"unrecognized arguments: {' '.join(remaining)}."
        if len(unknown) == 1 and suggestions:
            return f"{message} Did you mean {suggestions[0].split(' for ')[0]}?"
        if suggestions:
            return f"{message} Did you mean {', '.join(suggestions)}?"
        return f"{message} `--help` lists the options."

    def refuse_repeats(self, args: list[str] | None = None, hints: dict[str, str] | None = None) -> None:
        """Exit with an error when an option appears more than once in `args` (default: the command line); `hints`:
        what to do instead, by option."""
        args = sys.argv[1:] if args is None else args
        seen: dict[str, list[str]] = {}
        for i, word in enumerate(args):
            if word == "--":
                break
            option, _, inline = word.partition("=")
            action = self._option_string_actions.get(option)
            if action is None or action.dest == "help":
                continue
            value = inline if inline else (args[i + 1] if i + 1 < len(args) else "")
            seen.setdefault(action.option_strings[0], []).append(value)
        for option, values in seen.items():
            if len(values) > 1:
                given = ", ".join(repr(v) for v in values)
                hint = (hints or {}).get(option, "give it once")
                self.error(f"{option} was given {len(values)} times ({given}); {hint}.")


def command_name(module: str) -> str:
    """How the running command was typed, for its usage and error lines: the console script's name when it runs as
    one (`mm-fusion-export`), else `python -m <module>`."""
    name = os.path.basename(sys.argv[0]) if sys.argv else ""
    return name if name.startswith("mm-fusion-") else f"python -m {module}"


def parse_overrides(overrides: str | None, flag: str = "--config_overrides") -> dict:
    """`key=value,key=value` into a dict, values read as JSON when they parse (numbers, booleans, lists)."""
    result = {}
    # Commas inside brackets belong to a list value: `text_bridge_layers=[0,1],projection_dim=64`.
    for item in filter(None, re.split(r",(?![^\[]*\])", overrides or "")):
        if "=" not in item:
            raise ValueError(f"{flag} expects key=value pairs, got {item!r}.")
        key, value = item.split("=", 1)
        try:
            result[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            result[key.strip()] = value
    return result


__all__ = ["ScriptArgumentParser", "command_name", "parse_overrides"]
