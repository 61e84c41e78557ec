"""A griffe extension: reads tf_lars's Keras-style docstrings as Google style.

tf_lars writes its docstrings the way Keras does, and Python's doctest runs
them as they are (tests/docstrings_test.py); this rewrites two Keras habits,
for the documentation only, into what griffe's Google parser reads:

- `Example:` followed by an unindented block (`>>>` lines or a fenced block)
  becomes an indented `Examples:` section, so `>>>` lines render as code;
- an argument entry naming several arguments (`clipnorm, clipvalue, ...:`)
  becomes one entry per argument, each with the shared description.
"""

import re

import griffe

_SECTION = re.compile(r"^[A-Z][A-Za-z ]*:$")
_MULTI_NAME = re.compile(r"^(\s+)((?:\w+,\s*)+\w+):(.*)$")


def _indent_examples(lines):
    out, in_example = [], False
    for line in lines:
        if line.strip() == "Example:" and not line.startswith(" "):
            out.append("Examples:")
            in_example = True
            continue
        if in_example and _SECTION.match(line):
            in_example = False
        out.append("    " + line if in_example and line else line)
    return out


def _join_continued_names(lines):
    """`a, b,` / `c: text` over several lines becomes one line."""
    out = []
    for line in lines:
        if out and re.match(r"^\s+(\w+,\s*)+$", out[-1]) and re.match(r"^\s+\w", line):
            out[-1] = out[-1].rstrip() + " " + line.strip()
        else:
            out.append(line)
    return out


def _split_multi_names(lines):
    out, index = [], 0
    while index < len(lines):
        match = _MULTI_NAME.match(lines[index])
        index += 1
        if not match:
            out.append(lines[index - 1])
            continue
        indent, names, text = match.groups()
        parts = [text.strip()]
        while (
            index < len(lines)
            and lines[index].strip()
            and (len(lines[index]) - len(lines[index].lstrip()) > len(indent))
        ):
            parts.append(lines[index].strip())
            index += 1
        out += [
            f"{indent}{name.strip()}: {' '.join(parts)}" for name in names.split(",")
        ]
    return out


def rewrite(text):
    lines = _indent_examples(text.split("\n"))
    return "\n".join(_split_multi_names(_join_continued_names(lines)))


class KerasDocstrings(griffe.Extension):
    def on_instance(self, *, obj, **kwargs):
        if obj.docstring is not None:
            obj.docstring.value = rewrite(obj.docstring.value)
