"""The errors tf_lars raises about the installed TensorFlow and Keras.

Both are public so that a program can catch them (`except
tf_lars.MissingInternalError`); importing this module imports neither Keras
nor TensorFlow.

Examples:
    >>> import tf_lars
    >>> issubclass(tf_lars.UnsupportedVersionError, ImportError)
    True
"""

__all__ = ["MissingInternalError", "UnsupportedVersionError"]


class UnsupportedVersionError(ImportError):
    """The installed TensorFlow or Keras is older than tf_lars supports.

    Raised on the first use of an optimizer; the message names the installed
    versions and the supported range (`docs/guides/versions.md`). Setting
    `TF_LARS_SKIP_VERSION_CHECK=1` tries anyway.

    Examples:
        >>> import tf_lars
        >>> try:
        ...     optimizer = tf_lars.LARS(0.1)
        ... except tf_lars.UnsupportedVersionError as error:
        ...     print("upgrade:", error)
        >>> isinstance(optimizer, tf_lars.LARS)
        True
    """


class MissingInternalError(RuntimeError):
    """A private TensorFlow or Keras member tf_lars uses is gone or changed.

    Raised where the member is used (never at import), naming the tf_lars
    feature that needs it and the installed TensorFlow and Keras versions:
    a newer release than tf_lars was tested with changed what it relies on.

    Examples:
        >>> import tf_lars
        >>> error = tf_lars.MissingInternalError("tf_lars LAMB needs `Adam._momentums`")
        >>> isinstance(error, RuntimeError)
        True
    """
