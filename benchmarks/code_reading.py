"""What a reader of one rule reads: `python benchmarks/code_reading.py`.

Not part of the installed package: run it from a source checkout.

For each optimizer's dense step (Keras's `_backend_update_step`, which
`apply` calls), the functions of tf_lars it reaches, found by reading the
sources (Python's `ast`; nothing is imported or run): a call or reference
`self.name` resolved on the class (its method resolution order within
tf_lars; Keras's own classes are not counted), `super().name`, a function of
the same module, and a function imported from a tf_lars module (`from
tf_lars import _trust` then `_trust.norms`). Lambdas and nested functions
count as part of the function that holds them; an accessor of the version
fence (`_internals.py`, which reads Keras's and TensorFlow's private members)
counts, but what it calls does not, except where it calls the optimizer
back (`keras_update_step`: Keras's loop, which calls the class's
`update_step`, counted with what it reaches). Each row gives the functions,
their lines (`def` to last line, docstrings included), the files, and the
lines of `update_step`. The last table is the size budgets of
docs/guides/development.md ("What a reader reads, and the size budgets"):
`wc -l` of each part, and its lines split into code, docstrings, comment
lines and blank lines.
"""

import argparse
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
#: (row, module, class, entry): the portable rules and TensorFlow's
#: subclasses, from Keras's `_backend_update_step` (the loss scale, which
#: steps no variable itself, from its `apply`).
ROWS = [
    ("LARS", "tf_lars.lars", "LARS", "_backend_update_step"),
    ("LARS, TensorFlow", "tf_lars.backend.tensorflow", "LARS", "_backend_update_step"),
    ("LAMB", "tf_lars.lamb", "LAMB", "_backend_update_step"),
    ("LAMB, TensorFlow", "tf_lars.backend.tensorflow", "LAMB", "_backend_update_step"),
    ("TrustRatio", "tf_lars.trust_ratio", "TrustRatio", "_backend_update_step"),
    (
        "TrustRatio, TensorFlow",
        "tf_lars.backend.tensorflow",
        "TrustRatio",
        "_backend_update_step",
    ),
    ("LossScaleOptimizer", "tf_lars.loss_scale", "LossScaleOptimizer", "apply"),
]
#: Fence accessors that call the optimizer back: name -> the method reached.
CALLS_BACK = {"keras_update_step": "update_step"}
PARTS = {
    "package `tf_lars/`": ("", 8000),
    "core (`tf_lars/*.py`, `backend/`)": ("core", 3500),
    "`cli/`": ("cli", 2000),
    "`distribute/`": ("distribute", 2000),
}


class Module:
    """One source file: its functions, classes and tf_lars imports."""

    def __init__(self, path):
        tree = ast.parse(path.read_text())
        self.functions, self.classes, self.aliases = {}, {}, {}
        for node in tree.body:
            if isinstance(node, ast.FunctionDef):
                self.functions[node.name] = node
            elif isinstance(node, ast.ClassDef):
                self.classes[node.name] = node
        # Imports anywhere in the file (a function may import a module late).
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "tf_lars"
            ):
                for alias in node.names:
                    # `from tf_lars import _trust` (a module) or a name.
                    self.aliases[alias.asname or alias.name] = (node.module, alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("tf_lars.") and alias.asname:
                        module, _, name = alias.name.rpartition(".")
                        self.aliases[alias.asname] = (module, name)


def load(package):
    modules = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = Module(path)
    return modules


class Reader:
    def __init__(self, modules):
        self.modules = modules

    def symbol(self, module, name):
        """`(module, name)` where `name`, seen in `module`, is defined."""
        for _ in range(5):  # re-exports: a few hops at most
            mod = self.modules.get(module)
            if mod is None:
                return None
            if name in mod.functions or name in mod.classes:
                return module, name
            if name not in mod.aliases:
                return None
            source, original = mod.aliases[name]
            if f"{source}.{original}" in self.modules:
                return f"{source}.{original}", None  # a module
            module, name = source, original
        return None

    def bases(self, module, name):
        found = []
        for base in self.modules[module].classes[name].bases:
            if isinstance(base, ast.Name):
                target = self.symbol(module, base.id)
            elif isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name):
                target = self.symbol(module, base.value.id)
                if target and target[1] is None:
                    target = self.symbol(target[0], base.attr)
            else:
                target = None
            if target and target[1] and target[1] in self.modules[target[0]].classes:
                found.append(target)
        return found

    def mro(self, cls):
        """C3 linearization over the classes of tf_lars."""
        sequences = [self.mro(b) for b in self.bases(*cls)] + [self.bases(*cls)]
        order = [cls]
        while any(sequences):
            for sequence in sequences:
                head = sequence[0] if sequence else None
                if head and not any(head in s[1:] for s in sequences):
                    break
            else:
                raise ValueError(f"no linearization for {cls}")
            order.append(head)
            sequences = [s[1:] if s and s[0] == head else s for s in sequences]
        return order

    def method(self, mro, name, after=None):
        start = 0 if after is None else mro.index(after) + 1
        for cls in mro[start:]:
            for node in self.modules[cls[0]].classes[cls[1]].body:
                if isinstance(node, ast.FunctionDef) and node.name == name:
                    return cls, node
        return None

    def reached(self, module, class_name, entry):
        """Every function reached from `entry` of the class, as
        `{(module, qualified name): node}`."""
        mro = self.mro((module, class_name))
        found, todo = {}, []

        def visit(owner, node, module):
            key = (module, f"{owner[1]}.{node.name}" if owner else node.name)
            if key not in found:
                found[key] = node
                todo.append((owner, node, module))

        owner, node = self.method(mro, entry)
        visit(owner, node, owner[0])
        while todo:
            owner, function, module = todo.pop()
            if module.endswith("._internals"):
                continue  # the fence: an accessor of Keras's own, not followed
            for node in ast.walk(function):
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                    if node.value.id in ("self", "cls") and owner:
                        hit = self.method(mro, node.attr)
                        if hit:
                            visit(hit[0], hit[1], hit[0][0])
                        continue
                    target = self.symbol(module, node.value.id)
                    if target and target[1] is None:
                        self._function(target[0], node.attr, visit)
                        back = CALLS_BACK.get(node.attr)
                        if back and owner and self.method(mro, back):
                            visit(*self.method(mro, back), self.method(mro, back)[0][0])
                elif (
                    isinstance(node, ast.Attribute)
                    and isinstance(node.value, ast.Call)
                    and isinstance(node.value.func, ast.Name)
                    and node.value.func.id == "super"
                    and owner
                ):
                    hit = self.method(mro, node.attr, after=owner)
                    if hit:
                        visit(hit[0], hit[1], hit[0][0])
                elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
                    target = self.symbol(module, node.id)
                    if target and target[1]:
                        self._function(*target, visit)
        return found

    def _function(self, module, name, visit):
        target = self.symbol(module, name)
        if target and target[1] in self.modules[target[0]].functions:
            visit(None, self.modules[target[0]].functions[target[1]], target[0])


def lines(node):
    return node.end_lineno - node.lineno + 1


def wc(paths):
    """`(lines, code, docstrings, comments, blank)` over `paths`: `wc -l`,
    split by what each line is (a comment line holds only a comment)."""
    totals = [0] * 5
    for path in paths:
        text = path.read_text()
        docstrings = set()
        for node in ast.walk(ast.parse(text)):
            body = getattr(node, "body", None)
            if (
                isinstance(body, list)
                and body
                and isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef)
                and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                docstrings.update(range(body[0].lineno, body[0].end_lineno + 1))
        for number, line in enumerate(text.splitlines(), 1):
            stripped = line.strip()
            if number in docstrings:
                kind = 2
            elif not stripped:
                kind = 4
            else:
                kind = 3 if stripped.startswith("#") else 1
            totals[0] += 1
            totals[kind] += 1
    return tuple(totals)


def sizes(root):
    package = root / "tf_lars"
    every = sorted(package.rglob("*.py"))
    part = lambda p: p.relative_to(package).parts[0]  # noqa: E731
    by_part = {
        "": every,
        "cli": [p for p in every if part(p) == "cli"],
        "distribute": [p for p in every if part(p) == "distribute"],
    }
    by_part["core"] = [
        p for p in every if p not in by_part["cli"] + by_part["distribute"]
    ]
    tests = sorted((root / "tests").rglob("*.py"))
    rows = [(name, wc(by_part[key]), budget) for name, (key, budget) in PARTS.items()]
    return rows + [("`tests/`", wc(tests), 10000)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--list", action="store_true", help="name every function reached"
    )
    parser.add_argument(
        "--root",
        type=pathlib.Path,
        default=ROOT,
        help="the checkout to read (default: this one); a row whose class "
        "it lacks is left out",
    )
    args = parser.parse_args(argv)
    reader = Reader(load(args.root / "tf_lars"))
    print("| step of | functions | lines | files | `update_step` |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for row, module, name, entry in ROWS:
        if name not in getattr(reader.modules.get(module), "classes", {}):
            continue
        found = reader.reached(module, name, entry)
        files = sorted({m for m, _ in found})
        update = reader.method(reader.mro((module, name)), "update_step")
        where = "-"
        if update:
            where = f"{lines(update[1])} ({update[0][0].removeprefix('tf_lars.')})"
        print(
            f"| {row} | {len(found)} | {sum(map(lines, found.values()))} | "
            f"{len(files)} | {where} |"
        )
        if args.list:
            for module_name, function in sorted(found):
                print(f"|   | {module_name}: {function} | | | |")
    print()
    print("| part | lines | code | docstrings | comments | blank | budget |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, counts, budget in sizes(args.root):
        print(f"| {name} | {' | '.join(f'{n:,}' for n in counts)} | {budget:,} |")


if __name__ == "__main__":
    main()
