"""The `tf-lars` command line (`pip install ".[cli]"`): train, sweep.

Modules: `main` (the argparse entry, `tf-lars = tf_lars.cli.main:main`),
`config` (YAML defaults, merging, pydantic validation), `preflight`, `data`,
`train`, `sweep` and `plots`. Only `main` and this module load for
`tf-lars --help`: neither imports TensorFlow. A command calls
`set_tensorflow_log_level` and then `import_tensorflow` before anything else.

The package may import `tf_lars` and `tf_lars.distribute`; nothing there
imports it.
"""

__all__ = ["import_tensorflow", "set_tensorflow_log_level"]


def set_tensorflow_log_level(tf_log=False):
    """`tf_lars.distribute.logs.set_tensorflow_log_level`, imported when called.

    `tf_lars.distribute` needs Keras's TensorFlow backend; importing it
    here would make `tf-lars --help` fail on another backend.
    """
    from tf_lars.distribute.logs import set_tensorflow_log_level as set_level

    set_level(tf_log)


def import_tensorflow():
    """Imports TensorFlow (quietly: `tf_lars.distribute.logs`) and every
    public `tf_lars` name.

    Returns:
        The `tensorflow` module.
    """
    from tf_lars.distribute.logs import import_tensorflow_quietly

    tf = import_tensorflow_quietly()

    import tf_lars

    tf_lars.load_public_names()
    return tf
