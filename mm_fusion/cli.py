"""The argument parser of the scripts: a mistyped or repeated option is a one-line `error:` that names it."""

import difflib
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
    """

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")

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


__all__ = ["ScriptArgumentParser"]
