"""What the README, the documentation and pyproject.toml say about the project
itself stays true: versions, module paths, commands and file names.

Reads text only (no TensorFlow): the floors come from `tf_lars/_internals.py`'s
source and `pyproject.toml`, the commands from the CLI's own parser.
"""

import ast
import pathlib
import re
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
PYPROJECT_TEXT = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
PYPROJECT = tomllib.loads(PYPROJECT_TEXT)
DOCS = {
    path.relative_to(ROOT).as_posix(): path.read_text(encoding="utf-8")
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
}


def _supported_floors():
    """`SUPPORTED` of tf_lars/_internals.py: {package: "major.minor"} floors."""
    tree = ast.parse((ROOT / "tf_lars" / "_internals.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(target, ast.Name) and target.id == "SUPPORTED"
            for target in node.targets
        ):
            supported = ast.literal_eval(node.value)
            return {
                name: "{}.{}".format(*floor) for name, (floor, _) in supported.items()
            }
    raise AssertionError("no SUPPORTED in tf_lars/_internals.py")


def _declared_floor(requirements, name):
    for requirement in requirements:
        match = re.fullmatch(rf"{name}>=([\d.]+)", requirement.replace(" ", ""))
        if match:
            return match.group(1)
    raise AssertionError(f"no `{name}>=` in {requirements}")


def test_pyproject_states_the_floors_the_code_checks():
    floors = _supported_floors()
    project = PYPROJECT["project"]
    assert _declared_floor(project["dependencies"], "keras") == floors["keras"]
    extra = project["optional-dependencies"]["tensorflow"]
    assert _declared_floor(extra, "tensorflow") == floors["tensorflow"]


def test_the_home_pages_state_the_supported_floors():
    floors = _supported_floors()
    tf, keras = floors["tensorflow"], floors["keras"]
    index = DOCS["docs/index.md"]
    assert f"TensorFlow {tf}+ / Keras {keras}+" in index
    assert f"(TensorFlow {tf}+, Keras {keras}+)" in README
    # No other TensorFlow or Keras release is stated as what tf_lars is for.
    for page, text in (("docs/index.md", index), ("README.md", README[:400])):
        assert set(re.findall(r"TensorFlow (\d+\.\d+)", text)) == {tf}, page
        assert set(re.findall(r"Keras (\d+\.\d+)", text)) == {keras}, page


def test_the_python_row_follows_requires_python():
    match = re.fullmatch(r">=\s*(\d+\.\d+)", PYPROJECT["project"]["requires-python"])
    assert match, PYPROJECT["project"]["requires-python"]
    expected = f"{match.group(1)} and newer"
    for page in ("README.md", "docs/guides/versions.md"):
        rows = re.findall(r"^\| Python \| ([^|]+) \|", DOCS[page], re.MULTILINE)
        assert rows == [expected], (page, rows)


def _layout_block():
    guide = DOCS["docs/guides/development.md"]
    return re.search(r"## Layout.*?\n```\n(.*?)```", guide, re.DOTALL).group(1)


def test_every_module_the_development_guide_names_exists():
    guide = DOCS["docs/guides/development.md"]
    layout = _layout_block()
    # `cli/ ...: main, train, ...` lists the modules of tf_lars/cli/.
    listed = re.search(r"^  cli/ .*?\):(.*?)^\S", layout, re.DOTALL | re.MULTILINE)
    cli_modules = re.findall(r"\w+", listed.group(1))
    assert len(cli_modules) >= 6, cli_modules
    missing = [
        m for m in cli_modules if not (ROOT / "tf_lars/cli" / f"{m}.py").is_file()
    ]
    assert missing == [], f"tf_lars/cli/ has no {missing}"
    # Every `name.py` and `folder/` the guide names, where the layout puts it.
    folders = ["", "tf_lars", "tf_lars/backend", "tf_lars/distribute", "tf_lars/cli"]
    folders += ["benchmarks"]
    folders += ["examples", "tests", "tests/data", "configs", "docs", "docs/guides"]
    names = set(
        re.findall(r"(?<![\w/.*-])((?:[\w.-]+/)*[\w-]+\.(?:py|yaml|md))\b", guide)
    )
    assert len(names) >= 30, sorted(names)
    missing = [
        name
        for name in sorted(names)
        if not any((ROOT / folder / name).is_file() for folder in folders)
    ]
    assert missing == [], f"the development guide names missing files: {missing}"
    for folder in re.findall(r"^([\w.]+(?:/[\w.]+)*)/ ", layout, re.MULTILINE):
        assert (ROOT / folder).is_dir(), folder
    for folder in re.findall(r"^  (\w+)/ ", layout, re.MULTILINE):
        assert (ROOT / "tf_lars" / folder).is_dir(), folder


def _cli_commands():
    from tf_lars.cli import main

    parser = main._parser()
    (commands,) = [
        action.choices
        for action in parser._actions
        if getattr(action, "choices", None) and action.dest == "command"
    ]
    return set(commands)


# `tf-lars WORD` where a command starts: a line, a span, or after `&&` or `$`.
_COMMAND = re.compile(
    r"(?:^|`|&&|\$)[ \t]*tf-lars (?:--tf-log )?([a-z][\w-]*)", re.MULTILINE
)


def test_no_text_shows_a_tf_lars_command_the_cli_lacks():
    commands = _cli_commands()
    assert {"train", "study"} <= commands
    comments = "\n".join(
        line.split("#", 1)[1] for line in PYPROJECT_TEXT.splitlines() if "#" in line
    )
    texts = {**DOCS, "pyproject.toml (comments)": comments}
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        texts[path.relative_to(ROOT).as_posix()] = path.read_text(encoding="utf-8")
    shown = 0
    for name, text in texts.items():
        if "bench" not in commands:
            assert "tf-lars bench" not in text, name
        # In code spans and blocks: `tf-lars [--tf-log] WORD`, WORD a command.
        spans = re.findall(r"```[^\n]*\n.*?```|`[^`\n]+`", text, re.DOTALL)
        for span in spans:
            for word in re.findall(_COMMAND, span):
                shown += 1
                assert word in commands, f"{name}: `tf-lars {word}`"
    assert shown >= 20, shown


def _readme_paths():
    """Repository paths the README names in code spans and blocks, and links."""
    spans = re.findall(r"```[^\n]*\n.*?```|`[^`\n]+`", README, re.DOTALL)
    tokens = {
        token.strip("`'\",;:()[]")
        for span in spans
        for token in re.split(r"[\s=]+", span)
    }
    tops = {path.name for path in ROOT.iterdir()}
    paths = set()
    for token in tokens:
        if "<" in token or "://" in token or token.startswith("-"):
            continue  # placeholders such as runs/<name>/, addresses, options
        first = token.split("/", 1)[0]
        if ("/" in token and first in tops) or re.fullmatch(
            r"[\w.-]+\.(?:py|ya?ml|md|toml|json|txt)", token
        ):
            paths.add(token)
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README)
    paths |= {link for link in links if "://" not in link}
    return paths


def test_every_path_the_readme_names_exists():
    paths = _readme_paths()
    assert {"examples/train_lars.py", "configs/train.yaml", ".ci/run"} <= paths
    assert "docs/guides/cli.md" in paths
    # Files that the README's own commands write, not files of the repository.
    written = {"m.keras", "model.keras", "config.yaml", "history.json"}
    missing = sorted(
        path for path in paths - written if not (ROOT / path.rstrip("/")).exists()
    )
    assert missing == [], f"README.md names paths that do not exist: {missing}"


def test_the_site_s_navigation_keeps_project_pages_out_of_the_guides():
    import yaml

    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))["nav"]
    sections = {next(iter(entry)): next(iter(entry.values())) for entry in nav}
    assert list(sections)[:3] == ["Home", "Install", "Guides"]
    assert sections["Install"] == "install.md"
    guides = [next(iter(page.values())) for page in sections["Guides"]]
    project = [next(iter(page.keys())) for page in sections["Project"]]
    assert project == ["Development", "Supported versions", "Benchmarks", "Changelog"]
    assert not {"guides/development.md", "guides/versions.md"} & set(guides)
    assert "```python" in DOCS["docs/index.md"], "the home page's Python quickstart"
    install = DOCS["docs/install.md"]
    for extra in ("tensorflow", "cli", "test", "docs"):
        assert f'pip install ".[{extra}]"' in install, extra
    assert '"jax[cpu]"' in install and "KERAS_BACKEND=jax" in install
    assert "guides/versions.md" in install
