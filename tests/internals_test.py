"""Tests for the fence around private TensorFlow/Keras access (_internals.py)."""

import ast
import importlib
import importlib.util
import inspect
import pathlib
import pkgutil
import re
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_lars import _internals
from tf_lars.distribute import _internals as distribute_internals

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "tf_lars"

# Ways of reaching TensorFlow/Keras internals. The fences, `tf_lars/_internals.py`
# and `tf_lars/distribute/_internals.py`, are the modules allowed to use them.
FENCES = ("tf_lars._internals", "tf_lars.distribute._internals")
PRIVATE_ACCESS = re.compile(
    r"tensorflow\.python|keras\.src|tf\.__internal__|tf\.raw_ops\._"
    r"|\._cluster_resolver|\._cluster_coordinator|\._per_worker_vars"
    r"|\._distributed_container|\._values\b|\._initial_epoch|\._current_epoch"
)
#: The private Keras hooks tf_lars overrides, each fence's.
HOOKS = {*_internals.OVERRIDDEN_HOOKS, *distribute_internals.OVERRIDDEN_BACKUP_HOOKS}


def test_installed_versions_are_supported():
    _internals.check_versions(
        {"tensorflow": tf.__version__, "keras": keras.__version__}
    )


@pytest.mark.parametrize(
    "installed",
    [
        {"tensorflow": "2.16.2", "keras": "3.8.0"},
        {"tensorflow": "2.22.0", "keras": "3.15.1"},
        {"tensorflow": "2.21.0", "keras": "3.16.0.dev2026102704"},
        {"tensorflow": "2.23.0-dev20261120", "keras": "4.0.0"},
        {"tensorflow": "nightly", "keras": "3.15.1"},
    ],
)
def test_floor_and_newer_versions_import(installed):
    # Newer, untested releases pass the guard; their private accesses check
    # themselves where used.
    _internals.check_versions(installed)


@pytest.mark.parametrize(
    "installed, below",
    [
        ({"tensorflow": "2.15.1", "keras": "3.15.1"}, "tensorflow"),
        ({"tensorflow": "2.21.0", "keras": "3.7.0"}, "keras"),
        ({"tensorflow": "2.15.0", "keras": "2.15.0"}, "tensorflow/keras"),
    ],
)
def test_versions_below_the_floor_raise_one_clear_error(installed, below):
    with pytest.raises(_internals.UnsupportedVersionError) as error:
        _internals.check_versions(installed)
    message = str(error.value)
    assert f"tf_lars {below} version too old" in message
    assert f"tensorflow {installed['tensorflow']}" in message
    assert f"keras {installed['keras']}" in message
    assert "tensorflow>=2.16 (tested through 2.21)" in message
    assert "keras>=3.8 (tested through 3.15)" in message
    assert "\n" not in message


def test_private_access_only_in_the_fenced_module():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "_internals.py" and path.parent in (
            PACKAGE,
            PACKAGE / "distribute",
        ):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if PRIVATE_ACCESS.search(line):
                offenders.append(f"{path.relative_to(PACKAGE)}:{number}: {line}")
    assert offenders == []


def test_the_lars_docstring_documents_every_argument_once():
    # Written in the source, so `help()`, an IDE and the site (which reads
    # the source) show the same text; nothing is spliced in at import.
    import tf_lars
    from tf_lars import lars

    doc = tf_lars.LARS.__doc__
    (in_source,) = [
        node
        for node in ast.parse(pathlib.Path(lars.__file__).read_text()).body
        if isinstance(node, ast.ClassDef) and node.name == "LARS"
    ]
    assert ast.get_docstring(in_source) == inspect.cleandoc(doc)
    assert "{{" not in doc
    parameters = [
        name
        for name in inspect.signature(tf_lars.LARS.__init__).parameters
        if name not in ("self", "kwargs")
    ]
    assert "clipnorm" in parameters and "name" in parameters
    for name in parameters:
        entries = re.findall(rf"^ {{8}}{name}: ", doc, flags=re.MULTILINE)
        assert len(entries) == 1, (name, len(entries))
    assert len(re.findall(r"^ {8}\*\*kwargs: ", doc, flags=re.MULTILINE)) == 1


# --- private members of Keras / TensorFlow objects (inherited `self._x`) ---


def _is_private(name):
    return name.startswith("_") and not name.startswith("__")


def _foreign(cls):
    return cls.__module__.split(".")[0] in ("keras", "tensorflow")


def _foreign_private_names(cls):
    """Private names the Keras / TensorFlow classes in `cls`'s MRO define."""
    names = set()
    for base in cls.__mro__:
        if not _foreign(base):
            continue
        names.update(name for name in vars(base) if _is_private(name))
        try:
            names.update(name for name, _ in _private_uses(base))
        except (OSError, TypeError):  # no source: a compiled class
            continue
    return names


def _tf_lars_classes():
    import tf_lars

    for info in pkgutil.walk_packages(tf_lars.__path__, "tf_lars."):
        if info.name in FENCES:
            continue
        # A backend's subclasses only where that backend is installed.
        backend = info.name.removeprefix("tf_lars.backend.")
        if backend in ("jax", "tensorflow", "torch") and not importlib.util.find_spec(
            backend
        ):
            continue
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            if isinstance(value, type) and value.__module__ == info.name:
                yield value


def _private_uses(cls):
    """(name, line) of every `self._x` / `super()._x` and `def _x` in `cls`."""
    lines, first = inspect.getsourcelines(cls)
    tree = ast.parse(textwrap.dedent("".join(lines)))
    (class_node,) = tree.body
    for node in ast.walk(class_node):
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            owner = node.value
            is_self = isinstance(owner, ast.Name) and owner.id == "self"
            is_super = (
                isinstance(owner, ast.Call)
                and isinstance(owner.func, ast.Name)
                and owner.func.id == "super"
            )
            if is_self or is_super:
                yield node.attr, first + node.lineno - 1
    for node in class_node.body:
        if isinstance(node, ast.FunctionDef) and _is_private(node.name):
            yield node.name, first + node.lineno - 1


def test_no_private_keras_member_outside_the_fenced_module():
    # A tf_lars class that subclasses a Keras / TensorFlow class (mixins
    # through the subclass) may neither read, set nor override a private
    # member those classes define, except the hooks the fenced module lists.
    offenders = set()
    for cls in _tf_lars_classes():
        foreign_names = _foreign_private_names(cls)
        if not foreign_names:
            continue
        for own in cls.__mro__:
            if _foreign(own) or own.__module__ in FENCES:
                continue
            if own is object or not own.__module__.startswith("tf_lars"):
                continue
            for name, line in _private_uses(own):
                if name in foreign_names and name not in HOOKS:
                    offenders.add(f"{own.__module__}.{own.__name__}:{line}: {name}")
    assert sorted(offenders) == []


def test_the_fence_check_sees_inherited_private_members():
    # The checker itself: a subclass reading `self._get_variable_index` or
    # Adam's `_momentums` is found, and so is an override of a private hook
    # that is not in the list.
    class Probe(keras.optimizers.Adam):
        def update_step(self, gradient, variable, learning_rate):
            return self._momentums[self._get_variable_index(variable)]

        def _clip_gradients(self, grads):
            return grads

    found = {name for name, _ in _private_uses(Probe)}
    found &= _foreign_private_names(Probe)
    assert found == {"_momentums", "_get_variable_index", "_clip_gradients"}


def test_overridden_hooks_match_the_installed_keras():
    # Keras calls these on our optimizers: a changed signature is a break.
    for name, parameters in _internals.OVERRIDDEN_HOOKS.items():
        hook = getattr(keras.optimizers.Optimizer, name)
        assert tuple(inspect.signature(hook).parameters) == ("self", *parameters)
    _internals.check_hooks("SGD")
    # ... and these from `fit` on tf_lars.distribute.BackupAndRestore.
    for name, parameters in distribute_internals.OVERRIDDEN_BACKUP_HOOKS.items():
        hook = getattr(keras.callbacks.BackupAndRestore, name)
        assert tuple(inspect.signature(hook).parameters) == ("self", *parameters)
    distribute_internals.check_backup_hooks()


def test_a_keras_without_the_backup_hooks_is_named(monkeypatch):
    import tf_lars
    from tf_lars.distribute import BackupAndRestore

    monkeypatch.delattr(keras.callbacks.BackupAndRestore, "_save_model")
    with pytest.raises(tf_lars.MissingInternalError) as info:
        BackupAndRestore("backup")
    assert str(info.value).startswith(
        "tf_lars BackupAndRestore needs Keras to call "
        "`BackupAndRestore._save_model(self)` (found None), which the installed "
        "versions ("
    )


def test_the_errors_are_public_and_the_fence_raises_them():
    import tf_lars
    import tf_lars.errors

    assert tf_lars.UnsupportedVersionError is tf_lars.errors.UnsupportedVersionError
    assert tf_lars.MissingInternalError is tf_lars.errors.MissingInternalError
    assert issubclass(tf_lars.UnsupportedVersionError, ImportError)
    assert issubclass(tf_lars.MissingInternalError, RuntimeError)
    assert {"UnsupportedVersionError", "MissingInternalError"} <= set(tf_lars.__all__)
    # What the fence raises is what a user catches.
    with pytest.raises(tf_lars.UnsupportedVersionError):
        _internals.check_versions({"tensorflow": "2.15.1", "keras": "3.15.1"})
    with pytest.raises(tf_lars.MissingInternalError):
        _internals.adam_slots(keras.optimizers.SGD(), 0)


def test_the_errors_module_imports_neither_keras_nor_tensorflow():
    script = (
        "import sys, tf_lars; tf_lars.MissingInternalError; "
        "print(sorted(m for m in ('keras', 'tensorflow') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"


def test_a_changed_hook_fails_where_used_naming_feature_and_versions(monkeypatch):
    def changed(self, grads, trainable_variables):
        return None

    monkeypatch.setattr(keras.optimizers.Optimizer, "_backend_update_step", changed)
    import tf_lars

    optimizer = tf_lars.LARS(0.1)
    with pytest.raises(_internals.MissingInternalError) as error:
        optimizer.build([keras.Variable(np.ones((2,), "float32"))])
    message = str(error.value)
    assert "LARS needs Keras to call `Optimizer._backend_update_step(" in message
    assert f"keras {keras.__version__}" in message
    assert f"tensorflow {tf.__version__}" in message


def test_a_missing_member_fails_where_used_naming_feature_and_versions():
    with pytest.raises(_internals.MissingInternalError) as error:
        _internals.adam_slots(keras.optimizers.SGD(), 0)
    message = str(error.value)
    assert "tf_lars LAMB needs `SGD._momentums`" in message
    assert f"keras {keras.__version__}" in message


def test_import_tf_lars_loads_no_private_module():
    # Private modules load where used: with Keras's tracking module and
    # TensorFlow's per-worker variables gone, `import tf_lars` and LARS work;
    # AGN's build fails, naming itself.
    script = textwrap.dedent(
        """
        import sys
        import keras, keras.src.utils, numpy as np
        import tensorflow.python.distribute as distribute
        del keras.src.utils.tracking
        sys.modules["keras.src.utils.tracking"] = None
        sys.modules["tensorflow.python.distribute.ps_values"] = None
        if hasattr(distribute, "ps_values"):
            del distribute.ps_values
        import tf_lars
        variable = keras.Variable(np.ones((2,), "float32"))
        tf_lars.LARS(0.1, momentum=0.9).apply([np.ones((2,), "float32")], [variable])
        print("LARS", variable.numpy().tolist())
        try:
            tf_lars.AGN(keras.optimizers.SGD(0.1)).build([variable])
        except tf_lars.MissingInternalError as error:
            print("AGN", error)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0].startswith("LARS [")
    assert lines[1].startswith(
        "AGN tf_lars AGN needs the module `keras.src.utils.tracking`"
    )


def test_the_core_fence_holds_at_most_300_lines():
    # Accessors and the version check only (docs/guides/development.md).
    lines = (PACKAGE / "_internals.py").read_text().splitlines()
    assert len(lines) <= 300, len(lines)
