"""Every "step N" the code cites is docs/algorithms.md's step N, by its title.

docs/algorithms.md numbers the steps of each rule (LARS; TrustRatio and LAMB;
loss scaling) and names each in bold. The rule files cite them in one form,
"step N (title)", "steps N and M (title, title)", "steps N to M (...)" or
"steps N-M (...)": each cited number must exist in that rule's section and
the titles in parentheses must be the doc's, in order. A renumbered doc, or a
label that drifted to another step's number, fails here.
"""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
ALGORITHMS = ROOT / "docs" / "algorithms.md"
#: The section of docs/algorithms.md each rule file's citations refer to
#: (a citation may name another: "LARS's step 5").
FILES = {
    "tf_lars/lars.py": "LARS",
    "tf_lars/backend/tensorflow.py": "LARS",
    "tf_lars/lamb.py": "TrustRatio and LAMB",
    "tf_lars/trust_ratio.py": "TrustRatio and LAMB",
    "tf_lars/loss_scale.py": "Loss scaling",
}
_OWNER = {"LARS's": "LARS", "LAMB's": "TrustRatio and LAMB"}
_CITATION = re.compile(
    r"\b(?P<whose>LARS's |LAMB's )?[Ss]teps? "
    r"(?P<numbers>\d+(?:(?:, | and | to |-)\d+)*)"
    r"(?: \((?P<titles>[a-z][a-z ,]*?)\))?"
)
_ITEM = re.compile(r"^(\d+)\. \*\*([^*]+?)\.?\*\*", re.MULTILINE)


def doc_steps():
    """{section title: {step number: its bold title, lower case}}."""
    text = ALGORITHMS.read_text(encoding="utf-8")
    steps = {}
    for section in re.split(r"^## ", text, flags=re.MULTILINE)[1:]:
        title, _, body = section.partition("\n")
        body = body.split("\n### ")[0]
        items = {int(n): name.strip().lower() for n, name in _ITEM.findall(body)}
        if items:
            steps[title.strip()] = items
    return steps


def _numbers(text):
    bounds = [int(n) for n in re.findall(r"\d+", text)]
    if " to " in text or "-" in text:
        return list(range(bounds[0], bounds[-1] + 1))
    return bounds


def _flattened(source):
    """The source as one line: comment markers and line breaks become spaces,
    so that a citation wrapped over lines reads as one."""
    return re.sub(r"\s*\n\s*(?:#:?\s*)?", " ", source)


def citations(files=FILES):
    """(file, section, cited numbers, titles given or None), in file order."""
    found = []
    for relative, section in files.items():
        text = _flattened((ROOT / relative).read_text(encoding="utf-8"))
        for match in _CITATION.finditer(text):
            whose = (match.group("whose") or "").strip()
            titles = match.group("titles")
            found.append(
                (
                    relative,
                    _OWNER.get(whose, section),
                    _numbers(match.group("numbers")),
                    None if titles is None else re.split(r", | and ", titles),
                )
            )
    return found


def test_the_doc_numbers_each_rule_s_steps():
    steps = doc_steps()
    assert steps["LARS"] == {
        1: "decay in the gradient",
        2: "trust ratio",
        3: "local rate",
        4: "momentum",
        5: "sparse gradients",
    }
    assert list(steps["TrustRatio and LAMB"].values()) == [
        "inner step",
        "decay",
        "trust ratio",
        "clip",
        "update",
        "sparse gradients",
    ]
    assert list(steps["Loss scaling"])[:4] == [1, 2, 3, 4]


def test_the_rule_files_cite_their_steps():
    # Not vacuous: every rule file but the loss scale's cites steps.
    cited = {relative for relative, *_ in citations()}
    assert cited >= set(FILES) - {"tf_lars/loss_scale.py"}
    assert len(citations()) >= 25


@pytest.mark.parametrize(
    "where, section, numbers, titles",
    citations(),
    ids=lambda value: value if isinstance(value, str) else None,
)
def test_each_cited_step_exists_under_its_title(where, section, numbers, titles):
    steps = doc_steps()[section]
    for number in numbers:
        assert number in steps, f"{where}: {section} has no step {number}"
    expected = [steps[number] for number in numbers]
    assert titles == expected, (
        f"{where} cites {section} step(s) {numbers} as {titles}; the doc's "
        f"titles are {expected} (write them in parentheses after the number)"
    )


def test_a_drifted_label_is_caught(tmp_path):
    # trust_ratio.py once called the decay "step 1" and the sparse path "Step 5".
    drifted = tmp_path / "drifted.py"
    drifted.write_text(
        "# The decay is inside the ratio (step 1 (decay)).\n"
        "# Step 5 (sparse gradients): the inner optimizer's own update.\n"
        "# Steps 3 and\n# 4: the ratio and the write.\n"
    )
    found = [
        (numbers, titles)
        # An absolute path: `ROOT / drifted` is `drifted`.
        for _, _, numbers, titles in citations({drifted: "TrustRatio and LAMB"})
    ]
    steps = doc_steps()["TrustRatio and LAMB"]
    assert found == [([1], ["decay"]), ([5], ["sparse gradients"]), ([3, 4], None)]
    assert all([steps[n] for n in numbers] != titles for numbers, titles in found)
