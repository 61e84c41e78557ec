# The JAX and PyTorch backend tests (noxfile.py's BACKEND_TESTS) on a GPU:
# `bash benchmarks/gpu_backend_tests.sh OUT` from a source checkout, on a
# machine with CUDA builds of JAX and PyTorch. Wheels in `.whl/` (Keras and
# what it needs that the machine lacks) are installed first, if any. JAX's
# float32 matmuls run at full precision (on a GPU its default is TF32).
# Each backend's pytest log goes to OUT/<backend>.log. Not run by CI (no GPU
# there); docs/guides/backends.md, "On a GPU", has what it found.
set -u
out=${1:?give the folder for the logs}
if ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl || exit 1
fi
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
export JAX_DEFAULT_MATMUL_PRECISION=${JAX_DEFAULT_MATMUL_PRECISION:-highest}
# noxfile.py's BACKEND_TESTS, read without importing nox.
tests=$(python3 - <<'PY'
import ast

for node in ast.parse(open("noxfile.py").read()).body:
    if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "BACKEND_TESTS":
        print(" ".join(ast.literal_eval(node.value)))
PY
)
for backend in jax torch; do
    start=$(date +%s)
    KERAS_BACKEND=$backend timeout 600 python3 -m pytest -q -p no:cacheprovider -n 6 \
        -m "distributed or not distributed" --tb=short -rf $tests > "$out/$backend.log" 2>&1
    echo "$backend: exit $?, $(( $(date +%s) - start )) s"
    grep -E "passed|failed" "$out/$backend.log" | tail -1
    grep -E "^FAILED|^ERROR" "$out/$backend.log"
done
