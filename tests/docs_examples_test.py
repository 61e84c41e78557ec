"""Every Python block of the README and the documentation runs as pasted.

Each ```python block of `README.md`, `docs/*.md` and `docs/guides/*.md` runs
in a fresh interpreter (`python -c BLOCK`) in an empty folder, on Keras's
TensorFlow backend, and must exit with status 0; the blocks of the backends
guide run on JAX too. A block that cannot run on one machine is a fragment:
its first line is the marker `# fragment: needs <what>` (the convention of
docs/guides/development.md), and it only has to parse. Network connections
are refused in every run (a `sitecustomize` on the path), so a block that
downloads anything fails.

A block that trains (calls `.fit(` or an optimizer's `.apply(`) must show that
it learns: it prints `accuracy before training: 0.31` before training and
`accuracy after training: 0.97` after (or `loss before training: ...`), and the
printed numbers must improve by a margin, so a block that runs but does not
learn fails too.
"""

import concurrent.futures
import importlib.util
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "docs" / "guides").glob("*.md")),
]
# A fenced block and its language; the closing fence has the opening's indent.
_FENCE = re.compile(
    r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)[^\n]*\n"
    r"(?P<body>.*?)^(?P=indent)```[ \t]*$",
    re.MULTILINE | re.DOTALL,
)
MARKER = "# fragment: needs "
# Pages whose blocks are meant for any Keras backend: run on JAX as well.
ANY_BACKEND_PAGES = {"docs/guides/backends.md"}
# Lower bounds, so that the test cannot pass by finding nothing.
MIN_BLOCKS = 20
MIN_RUNNABLE = 15
TIMEOUT_S = 300
# What a block must not do: fetch data or models from the network.
_DOWNLOADS = re.compile(
    r"keras\.datasets|get_file|urlopen|urllib|requests\.|https?://|tfds\.|"
    r"weights=\"imagenet\"|hf_hub|from_pretrained"
)
# Refuses every connection to an internet address in the block's process.
_NO_NETWORK = """\
import socket

_connect = socket.socket.connect
_connect_ex = socket.socket.connect_ex
_getaddrinfo = socket.getaddrinfo
_LOCAL = {None, "localhost", "127.0.0.1", "::1", ""}


def _check(family, address):
    if family in (socket.AF_INET, socket.AF_INET6):
        host = address[0] if isinstance(address, tuple) else address
        if host not in _LOCAL:
            raise OSError(f"docs_examples_test: no network: connect to {address!r}")


def connect(self, address):
    _check(self.family, address)
    return _connect(self, address)


def connect_ex(self, address):
    _check(self.family, address)
    return _connect_ex(self, address)


def getaddrinfo(host, *args, **kwargs):
    if host not in _LOCAL:
        raise OSError(f"docs_examples_test: no network: look up {host!r}")
    return _getaddrinfo(host, *args, **kwargs)


socket.socket.connect = connect
socket.socket.connect_ex = connect_ex
socket.getaddrinfo = getaddrinfo
"""


def _blocks():
    """(label, language, body) of every fenced block of the pages, in order."""
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for match in _FENCE.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            label = f"{page.relative_to(ROOT).as_posix()}:{line}"
            body = textwrap.dedent(match.group("body"))
            found.append((label, match.group("lang"), body))
    return found


BLOCKS = _blocks()
PYTHON = [(label, body) for label, lang, body in BLOCKS if lang == "python"]
FRAGMENTS = [(label, body) for label, body in PYTHON if body.startswith(MARKER)]
RUNNABLE = [(label, body) for label, body in PYTHON if not body.startswith(MARKER)]
_SETS_BACKEND = re.compile(r"""^os\.environ\["KERAS_BACKEND"\] = "(\w+)"$""", re.M)


def _backends(label, body):
    """Where a block runs: the backend it sets itself, else TensorFlow (and JAX
    on the pages meant for any backend)."""
    own = _SETS_BACKEND.findall(body)
    if own:
        return own[:1]
    if label.rsplit(":", 1)[0] in ANY_BACKEND_PAGES:
        return ["tensorflow", "jax"]
    return ["tensorflow"]


def _missing_module(body):
    """A backend package the block imports that is not installed, or None."""
    for name in ("jax", "torch"):
        if re.search(rf"^\s*(?:import|from) {name}\b", body, re.MULTILINE):
            if importlib.util.find_spec(name) is None:
                return name
    for name in _SETS_BACKEND.findall(body):
        if name in ("jax", "torch") and importlib.util.find_spec(name) is None:
            return name
    return None


#: A block that imports JAX or PyTorch is collected only where that package is
#: installed: never skipped. The README's test environment has neither; .ci/run
#: runs the backends guide's JAX block after installing JAX (`-k jax`, which
#: fails with exit status 5 if nothing is collected).
CASES = [
    (label, backend)
    for label, body in RUNNABLE
    for backend in _backends(label, body)
    if _missing_module(body) is None
]
_BODIES = dict(PYTHON)
# A block that trains, and the lines it prints to show that it learned.
_TRAINS = re.compile(r"\.fit\(|\.apply\(")
_LEARNED = re.compile(
    r"^(?P<metric>accuracy|loss) (?P<when>before|after) training: (?P<value>\S+)$",
    re.MULTILINE,
)
#: What training must do to the printed metric: raise an accuracy by at least
#: ACCURACY_GAIN (a chance-level example gains nothing), or cut a loss to at
#: most LOSS_KEPT of its value before training.
ACCURACY_GAIN = 0.25
LOSS_KEPT = 0.5
TRAINING = [label for label, body in RUNNABLE if _TRAINS.search(body)]
LEARNING_CASES = [(label, backend) for label, backend in CASES if label in TRAINING]
# The command-line guide's TrustRatioMonitor example, which must also learn.
MONITOR = [
    label
    for label, body in RUNNABLE
    if label.startswith("docs/guides/cli.md:") and "TrustRatioMonitor(" in body
]


def _run(body, backend, folder):
    """Runs `body` as `python -c body` in `folder`, with no network."""
    guard = folder / "_guard"
    guard.mkdir(exist_ok=True)
    (guard / "sitecustomize.py").write_text(_NO_NETWORK, encoding="utf-8")
    work = folder / "work"
    work.mkdir(exist_ok=True)
    env = dict(os.environ)
    env.update(KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3", MPLBACKEND="Agg")
    path = [str(guard), str(ROOT), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(part for part in path if part)
    return subprocess.run(
        [sys.executable, "-c", body],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


@pytest.fixture(scope="module")
def results(request, tmp_path_factory):
    """The selected cases' runs, two at a time where the machine has the CPUs."""
    mine = [
        item
        for item in request.session.items
        if item.nodeid.split("::")[0].endswith("docs_examples_test.py")
    ]
    selected = [
        (item.callspec.params["label"], item.callspec.params["backend"])
        for item in mine
        if item.originalname
        in ("test_block_runs_as_pasted", "test_the_training_example_learns")
    ]
    if any(item.originalname == "test_the_monitor_example_learns" for item in mine):
        selected += [(label, "tensorflow") for label in MONITOR]
    jobs = list(dict.fromkeys(selected))
    workers = int(os.environ.get("DOCS_EXAMPLES_JOBS", min(2, os.cpu_count() or 1)))

    # The folders are made here, in one thread: two threads making the first
    # folder of an xdist worker race on its base folder (FileExistsError).
    folders = {
        case: tmp_path_factory.mktemp(re.sub(r"\W+", "_", "_".join(case)))
        for case in jobs
    }

    def run(case):
        label, backend = case
        return case, _run(_BODIES[label], backend, folders[case])

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return dict(pool.map(run, jobs))


def test_the_pages_hold_enough_blocks():
    assert len(PAGES) >= 12
    assert len(PYTHON) >= MIN_BLOCKS, [label for label, _ in PYTHON]
    assert len(RUNNABLE) >= MIN_RUNNABLE, [label for label, _ in RUNNABLE]
    assert any(label.startswith("docs/index.md:") for label, _ in RUNNABLE)
    # A JAX block exists whatever is installed; it is collected where JAX is.
    assert any("jax" in _backends(label, body) for label, body in RUNNABLE)
    if importlib.util.find_spec("jax") is not None:
        assert any(backend == "jax" for _, backend in CASES)


def test_python_blocks_use_the_one_fence_name():
    """A block fenced as `py` or `python3` would escape this test."""
    odd = [
        (label, lang)
        for label, lang, _ in BLOCKS
        if lang.lower() in {"py", "python3", "pycon", "ipython", "pyi"}
    ]
    assert odd == []


def test_every_fragment_carries_the_marker_on_its_first_line_and_parses():
    assert FRAGMENTS, "the cluster examples are fragments"
    for label, body in PYTHON:
        first, *rest = body.splitlines()
        assert not any("# fragment:" in line for line in rest), (
            f"{label}: the marker goes on the first line only"
        )
        if first.startswith(MARKER):
            assert len(first) > len(MARKER) + 3, f"{label}: say what it needs"
        compile(body, label, "exec")  # a SyntaxError names the block


def test_the_development_guide_states_the_marker():
    guide = (ROOT / "docs" / "guides" / "development.md").read_text(encoding="utf-8")
    assert MARKER.strip() in guide
    assert "tests/docs_examples_test.py" in guide


@pytest.mark.parametrize("label", TRAINING)
def test_every_training_example_prints_before_and_after(label):
    """Read without running it: the block prints its metric before and after
    training (`test_the_training_example_learns` runs it and compares)."""
    body = _BODIES[label]
    prints = re.findall(
        r"""print\(f["'](accuracy|loss) (before|after) training: """, body
    )
    assert len(prints) == 2 and {when for _, when in prints} == {"before", "after"}, (
        f'{label} trains: make it print f"accuracy before training: {{...:.2f}}" '
        'before it trains and f"accuracy after training: {...:.2f}" after (or '
        "`loss ...`), from data it makes learnable (labels a function of the inputs)"
    )
    assert prints[0][1] == "before" and prints[0][0] == prints[1][0], prints


def _learned(out):
    """The metric a block printed, and its values before and after training."""
    found = {}
    for match in _LEARNED.finditer(out):
        key = (match["metric"], match["when"])
        assert key not in found, f"printed twice: {match.group(0)!r}"
        found[key] = float(match["value"])
    metrics = {metric for metric, _ in found}
    assert len(metrics) == 1 and len(found) == 2, (
        "expected one `<accuracy|loss> before training: X` line and one "
        f"`... after training: Y` line, found {found}:\n{out[-3000:]}"
    )
    (metric,) = metrics
    return metric, found[(metric, "before")], found[(metric, "after")]


def _improved(metric, before, after):
    """Whether training moved the metric by the margin."""
    if metric == "accuracy":
        return after >= before + ACCURACY_GAIN
    return after <= LOSS_KEPT * before


def test_the_learned_lines_are_read_and_judged():
    """The parser and the margins, on outputs made up here."""
    out = (
        "accuracy before training: 0.33\n"
        "Epoch 1/2\n16/16 - 0s - accuracy: 0.8 - loss: 0.5\n"
        "accuracy after training: 0.95\n"
    )
    assert _learned(out) == ("accuracy", 0.33, 0.95)
    assert _learned("loss before training: 8.1\nloss after training: 0.09\n") == (
        "loss", 8.1, 0.09,
    )  # fmt: skip
    for bad in (
        "accuracy before training: 0.33\n",  # no after
        "accuracy before training: 0.3\nloss after training: 0.1\n",  # two metrics
        "loss before training: 1\nloss after training: 2\nloss after training: 3\n",
    ):
        with pytest.raises(AssertionError):
            _learned(bad)
    assert not _improved("accuracy", 0.33, 0.30)  # the example: chance
    assert not _improved("accuracy", 0.33, 0.56)
    assert _improved("accuracy", 0.33, 0.59)
    assert not _improved("loss", 8.0, 4.1)
    assert _improved("loss", 8.0, 4.0)
    assert not _improved("loss", float("nan"), float("nan"))


def test_no_block_downloads_anything():
    found = [
        (label, m.group(0)) for label, body in PYTHON for m in _DOWNLOADS.finditer(body)
    ]
    assert found == []


def test_the_network_guard_refuses_a_download(tmp_path):
    body = (
        "import urllib.request\n"
        'urllib.request.urlopen("http://example.com", timeout=5)\n'
    )
    done = _run(body, "tensorflow", tmp_path)
    assert done.returncode != 0
    assert "docs_examples_test: no network" in done.stderr


def test_a_failing_block_fails_the_run(tmp_path):
    done = _run("model.fit(x, y)\n", "tensorflow", tmp_path)
    assert done.returncode != 0
    assert "NameError: name 'model' is not defined" in done.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    ("label", "backend"), CASES, ids=[f"{label}-{backend}" for label, backend in CASES]
)
def test_block_runs_as_pasted(label, backend, results):
    done = results[(label, backend)]
    assert done.returncode == 0, (
        f"{label} on {backend} exited with {done.returncode} (mark it as a fragment "
        f"with a first line `{MARKER}<what>` only if it cannot run on one machine):\n"
        f"{done.stderr[-3000:]}"
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("label", "backend"),
    LEARNING_CASES,
    ids=[f"{label}-{backend}" for label, backend in LEARNING_CASES],
)
def test_the_training_example_learns(label, backend, results):
    """The metric the block prints after training beats the one before by the
    margin: accuracy up by ACCURACY_GAIN, or loss down to LOSS_KEPT of it."""
    done = results[(label, backend)]
    assert done.returncode == 0, f"{label} on {backend} failed:\n{done.stderr[-3000:]}"
    metric, before, after = _learned(done.stdout)
    assert _improved(metric, before, after), (
        f"{label} on {backend} does not learn: {metric} {before} before training, "
        f"{after} after (needed: "
        + (
            f"at least {before + ACCURACY_GAIN:.2f})"
            if metric == "accuracy"
            else f"at most {LOSS_KEPT * before:.4g})"
        )
    )


@pytest.mark.slow
def test_the_monitor_example_learns(results):
    """The command-line guide's TrustRatioMonitor example trains: logits, and a loss
    made for them, so its loss falls by a third in its three epochs."""
    assert len(MONITOR) == 1, MONITOR
    out = results[(MONITOR[0], "tensorflow")].stdout
    # The last loss the progress bar shows in each epoch.
    epochs = re.split(r"Epoch \d+/\d+", out)[1:]
    losses = [float(re.findall(r"- loss: ([0-9.]+)", epoch)[-1]) for epoch in epochs]
    assert len(losses) == 3, out[-2000:]
    assert losses[-1] < 0.67 * losses[0], losses
