"""What LARS's XLA step cannot go below on a CPU, and what was tried.

    python benchmarks/xla_floor.py [--size 9437184] [--repeats 40]

One float32 tensor of `--size` entries (a ResNet-50 conv kernel's 2.4M, four
times), each row a `tf.function(jit_compile=True)`, timed one call of each row
in turn (`bench._turns`): the median call and the bytes per entry its
optimized HLO reads and writes (`hlo_traffic`).

- norms: `reduce_sum(square(x))` against the folded matrix-vector product
  tf_lars takes under XLA (`tf_lars.backend.tensorflow.sum_of_squares`);
- updates: SGD-momentum (`m = 0.9 m - lr g; w += m`) and LARS's
  (`m = 0.9 m + c (g + wd w); w -= m`) as written, which XLA's CPU backend
  emits as two passes (the second reads the new `m` back, and `w` again);
  LARS's with `w`'s new value written from the same inputs (`sibling`: XLA
  merges it back into the two passes); and LARS's in one pass per chunk of
  `--chunk` entries (`chunked`: a `while` loop of dynamic slices), which
  would read each input once, but XLA's CPU backend copies the loop's
  whole state at every iteration.

So LARS's step moves the norms' 8 bytes per entry plus the update's 28, and
SGD-momentum's 24: 36 / 24 = 1.5x by bytes, with nothing on this backend
that writes `m` and `w` in one pass (docs/guides/benchmarks.md).
"""

import argparse
import os
import statistics
import sys

# This checkout's tf_lars, as benchmarks/bench.py times it.
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

MOMENTUM, RATE, DECAY = 0.9, 0.01, 1e-4


def rows(size, chunk):
    """`{name: (compiled function, its argument)}` over one tensor."""
    import tensorflow as tf
    from tensorflow.compiler.tf2xla.python import xla

    from tf_lars.backend import tensorflow as tf_backend

    w = tf.Variable(tf.random.stateless_normal([size], [0, 1]))
    m = tf.Variable(tf.zeros([size]))
    g = tf.random.stateless_normal([size], [0, 2])

    def sgd(g):
        m.assign(MOMENTUM * m - RATE * g)
        w.assign_add(m)
        return tf.zeros([])

    def lars(g):
        m.assign(MOMENTUM * m + RATE * (g + DECAY * w))
        w.assign_sub(m)
        return tf.zeros([])

    def sibling(g):
        new_m = MOMENTUM * m + RATE * (g + DECAY * w)
        w.assign(w - (MOMENTUM * m + RATE * (g + DECAY * w)))
        m.assign(new_m)
        return tf.zeros([])

    def chunked(g):
        def body(i, m_all, w_all):
            at = [i * chunk]
            m_part, w_part = tf.slice(m_all, at, [chunk]), tf.slice(w_all, at, [chunk])
            g_part = tf.slice(g, at, [chunk])
            m_part = MOMENTUM * m_part + RATE * (g_part + DECAY * w_part)
            return (
                i + 1,
                xla.dynamic_update_slice(m_all, m_part, at),
                xla.dynamic_update_slice(w_all, w_part - m_part, at),
            )

        start = [tf.constant(0), m.read_value(), w.read_value()]
        _, new_m, new_w = tf.while_loop(lambda i, *_: i < size // chunk, body, start)
        m.assign(new_m)
        w.assign(new_w)
        return tf.zeros([])

    functions = {
        "norm: reduce_sum(square(x))": lambda x: tf.reduce_sum(tf.square(x)),
        "norm: folded (tf_lars)": tf_backend.sum_of_squares,
        "update: SGD-momentum": sgd,
        "update: LARS, as written": lars,
        "update: LARS, sibling": sibling,
        "update: LARS, chunked": chunked,
    }
    return {
        name: (tf.function(function, jit_compile=True), g)
        for name, function in functions.items()
    }


def measure(size, chunk, repeats):
    """`{name: (median seconds, bytes read per entry, bytes written per entry)}`."""
    from benchmarks import bench, hlo_traffic

    compiled = rows(size, chunk)
    measured = {}
    for name, (function, argument) in compiled.items():
        text = function.experimental_get_compiler_ir(argument)(stage="optimized_hlo")
        measured[name] = hlo_traffic.traffic(text)
    steps = {
        name: lambda f=function, a=argument: f(a).numpy()
        for name, (function, argument) in compiled.items()
    }
    times = bench._turns(steps, repeats, warmup=2)
    return {
        name: (statistics.median(times[name]), t.read / size, t.written / size)
        for name, t in measured.items()
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=4 * 2_359_296)
    parser.add_argument("--chunk", type=int, default=2_359_296 // 2)
    parser.add_argument("--repeats", type=int, default=40)
    args = parser.parse_args(argv)
    if args.size % args.chunk:
        parser.error(f"--size must be a multiple of --chunk ({args.chunk})")
    results = measure(args.size, args.chunk, args.repeats)
    print(f"{args.size:,} float32 entries, {args.repeats} calls of each row in turn")
    width = max(map(len, results)) + 2
    print(f"{'':{width}}{'median (ms)':>12}{'read B':>9}{'written B':>11}{'GB/s':>7}")
    for name, (seconds, read, written) in results.items():
        rate = (read + written) * args.size / seconds / 1e9
        print(
            f"{name:{width}}{1e3 * seconds:>12.2f}{read:>9.2f}{written:>11.2f}"
            f"{rate:>7.1f}"
        )


if __name__ == "__main__":
    main()
