"""
Class labels as users write them. A label is a class name: `1`, `1.0`, `"1"` and `"1.0"` name the same class, `"1"`
(a table's cells are text, and pandas exports a column of integers with one blank as floats);
surrounding spaces are not part of the name. A missing label, `null`, `NaN`, an empty text or a value that is not one
value (a list, an object) is not a label: its row is quarantined. Classes are ordered by name, numerically when every
name is a whole number, so labels 0 to K-1 keep their numbers as class indices.
"""

import json
import math
import re
from collections.abc import Iterable
from typing import Any

from ..image_processing_mm_fusion import BadSample


def label_name(value: Any) -> str:
    """The class a label value names, or `BadSample("bad_label", ...)` saying why it names none."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        raise BadSample("bad_label", "no label (null or absent)")
    if isinstance(value, bool):
        return "true" if value else "false"  # as JSON writes them
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isinf(value):
            raise BadSample("bad_label", f"{value} is not a class")
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, str):
        if not value.strip():
            raise BadSample("bad_label", f"an empty label {value!r}")
        name = value.strip()
        return name.split(".")[0] if re.fullmatch(r"-?\d+\.0+", name) else name
    try:
        shown = json.dumps(value)
    except TypeError:
        shown = repr(value)
    raise BadSample("bad_label", f"not one value but a {type(value).__name__}: {shown:.80}")


def class_names(values: Iterable[Any]) -> list[str]:
    """The distinct classes that the label values name (values that name none are skipped), in class order."""
    names = set()
    for value in values:
        try:
            names.add(label_name(value))
        except BadSample:
            pass
    if names and all(re.fullmatch(r"-?\d+", name) for name in names):
        return sorted(names, key=int)
    return sorted(names)
