"""Data loading for the `tf-lars` command line.

The default data set is scikit-learn's handwritten digits (1,797 8x8 images,
10 classes, shipped inside scikit-learn: nothing is downloaded), split once
into train and test with a fixed seed and stratified by class. A user's data
is an `.npz` file with the arrays `x_train, y_train, x_test, y_test`.
Every problem with the data is a `DataError` with a one-line message.
"""

import collections
import math
import os
import zipfile

import numpy as np

from tf_lars.cli.config import MAX_CLASSES, one_line

REQUIRED_ARRAYS = ("x_train", "y_train", "x_test", "y_test")

Dataset = collections.namedtuple(
    "Dataset", ["x_train", "y_train", "x_test", "y_test", "num_classes", "source"]
)


class DataError(ValueError):
    """Unusable training data; the message is one line for the user."""


def load_data(data_config):
    """Loads the data set a validated `data` config block names."""
    if data_config["path"] is None:
        return _load_digits(data_config)
    return _load_npz(data_config)


def _load_digits(data_config):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32).reshape(-1, 8, 8, 1)
    split = train_test_split(
        x,
        y,
        test_size=data_config["test_fraction"],
        random_state=data_config["split_seed"],
        stratify=y,
    )
    source = (
        "scikit-learn digits (8x8), stratified split "
        f"test_fraction={data_config['test_fraction']} "
        f"split_seed={data_config['split_seed']}"
    )
    # train_test_split returns x_train, x_test, y_train, y_test.
    return _finish(
        *split[::2], *split[1::2], data_config["num_classes"], source, "digits"
    )


#: The problem `synthetic_data` makes: scikit-learn's `make_classification`.
SYNTHETIC = {
    "n_samples": 40_000,
    "n_features": 64,
    "n_informative": 40,
    "n_redundant": 8,
    "n_classes": 10,
    "n_clusters_per_class": 2,
    "class_sep": 1.5,
    "flip_y": 0.0,
}
SYNTHETIC_TEST = 10_000


def synthetic_data(seed):
    """A classification problem made at run time, larger than digits.

    scikit-learn's `make_classification` with `SYNTHETIC`'s settings and
    `random_state=seed`: 40,000 examples of 64 features in 10 classes, the
    last 10,000 held out as the test set. Nothing is downloaded.
    """
    from sklearn.datasets import make_classification

    x, y = make_classification(**SYNTHETIC, random_state=seed)
    cut = SYNTHETIC["n_samples"] - SYNTHETIC_TEST
    source = (
        "synthetic: scikit-learn make_classification, 40,000 examples, 64 "
        f"features, 10 classes, random_state={seed}"
    )
    return _finish(x[:cut], y[:cut], x[cut:], y[cut:], None, source, "synthetic")


def cache_folder():
    """Where generated data sets are kept between runs: `$TF_LARS_CACHE`,
    else `$XDG_CACHE_HOME/tf_lars`, else `~/.cache/tf_lars`."""
    if os.environ.get("TF_LARS_CACHE"):
        return os.environ["TF_LARS_CACHE"]
    home = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(home, "tf_lars")


def load_mnist1d(num_samples, seed):
    """mnist1d (Greydanus 2020), generated here by the `mnist1d` package.

    `make_dataset(get_dataset_args())` with `num_samples` examples and
    `seed`: NumPy only, nothing downloaded; the package keeps 20% as the
    test set. 40 features, 10 classes. Generating 16,000 examples takes
    about 12 CPU seconds, so the arrays are kept in `cache_folder()` (one
    `.npz` per package version, size and seed, written whole or not at
    all) and read back by the next run; an unreadable file is generated
    again, and a folder that cannot be written only costs the time.
    """
    import importlib.metadata

    from mnist1d.data import get_dataset_args, make_dataset

    version = importlib.metadata.version("mnist1d")
    folder, keys = cache_folder(), ("x", "y", "x_test", "y_test")
    path = os.path.join(folder, f"mnist1d-{version}-{num_samples}-{seed}.npz")
    try:
        with np.load(path) as kept:
            made = {key: kept[key] for key in keys}
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
        arguments = get_dataset_args()
        arguments.num_samples, arguments.seed = num_samples, seed
        made = make_dataset(arguments)
        partial = f"{path}.{os.getpid()}.partial.npz"
        try:
            os.makedirs(folder, exist_ok=True)
            np.savez(partial, **{key: made[key] for key in keys})
            os.replace(partial, path)
        except OSError:
            if os.path.exists(partial):
                os.remove(partial)
    source = f"mnist1d, {num_samples} examples generated with seed {seed}"
    return _finish(
        made["x"], made["y"], made["x_test"], made["y_test"], 10, source, "mnist1d"
    )


def split_validation(data, fraction, seed):
    """`(training, validation)`: `fraction` of the training set held out,
    stratified by class; both keep the test set."""
    from sklearn.model_selection import train_test_split

    x_train, x_val, y_train, y_val = train_test_split(
        data.x_train,
        data.y_train,
        test_size=fraction,
        random_state=seed,
        stratify=data.y_train,
    )
    return data._replace(x_train=x_train, y_train=y_train), (x_val, y_val)


def _load_npz(data_config):
    path = data_config["path"]
    where = f"data.path={path}"
    if not os.path.isfile(path):
        raise DataError(f"{where}: file not found")
    if not zipfile.is_zipfile(path):
        raise DataError(
            f"{where}: not an .npz archive; the file must be what "
            f"numpy.savez writes, with the numeric arrays {', '.join(REQUIRED_ARRAYS)}"
        )
    try:
        with np.load(path, allow_pickle=False) as archive:
            names = sorted(archive.files)
            missing = [name for name in REQUIRED_ARRAYS if name not in names]
            if missing:
                raise DataError(
                    f"{where}: missing array(s) {', '.join(missing)}; the file has "
                    f"{', '.join(names) or 'no arrays'}; expected "
                    f"{', '.join(REQUIRED_ARRAYS)}"
                )
            for name in REQUIRED_ARRAYS:
                _check_stored_size(archive.zip, name, where)
            arrays = {name: archive[name] for name in REQUIRED_ARRAYS}
    except DataError:
        raise
    except MemoryError as error:
        raise DataError(f"{where}: cannot read as .npz ({one_line(error)})") from None
    except ValueError as error:
        if "allow_pickle" not in str(error):
            detail = one_line(error)
            raise DataError(f"{where}: cannot read as .npz ({detail})") from None
        # NumPy would suggest `allow_pickle=True`, which runs code stored in
        # the file; the arrays must be numeric instead.
        raise DataError(
            f"{where}: holds object (pickled) arrays, which are not loaded: "
            f"{', '.join(REQUIRED_ARRAYS)} must be numeric arrays"
        ) from None
    except (RuntimeError, NotImplementedError) as error:
        # zipfile's errors for an encrypted member and a compression method
        # it does not know: numpy.savez writes neither.
        detail = "a member is encrypted" if "encrypted" in str(error) else error
        raise DataError(
            f"{where}: cannot read as .npz ({one_line(detail)}); the file must be "
            "what numpy.savez writes"
        ) from None
    except (OSError, zipfile.BadZipFile, EOFError) as error:
        raise DataError(f"{where}: cannot read as .npz ({one_line(error)})") from None
    arrays = [arrays[name] for name in REQUIRED_ARRAYS]
    return _finish(*arrays, data_config["num_classes"], path, where)


def _check_stored_size(archive, name, where):
    """Refuses an array whose header claims more bytes than the file stores.

    NumPy allocates what the header of an `.npy` member claims before it
    reads the data: a few bytes of header can ask for petabytes.
    """
    member = f"{name}.npy" if f"{name}.npy" in archive.namelist() else name
    info = archive.getinfo(member)
    with archive.open(info) as stream:
        version = np.lib.format.read_magic(stream)
        read_header = {
            (1, 0): np.lib.format.read_array_header_1_0,
            (2, 0): np.lib.format.read_array_header_2_0,
        }.get(version)
        if read_header is None:
            return  # a newer format: `np.load` reads it (a MemoryError is caught)
        shape, _, dtype = read_header(stream)
    if dtype.hasobject:
        return  # pickled: refused when loaded
    claimed = math.prod(shape) * dtype.itemsize
    if claimed > info.file_size:
        raise DataError(
            f"{where}: {name} claims shape {shape} ({claimed} bytes of {dtype}) but "
            f"the file stores {info.file_size} bytes for it; the file is damaged "
            "or not what numpy.savez writes"
        )


def _labels(name, y, where):
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.ndim != 1:
        raise DataError(
            f"{where}: {name} must be a 1-D array of class ids, got shape {y.shape}"
        )
    integral = y.dtype.kind in "iu" or (
        y.dtype.kind == "f" and np.all(np.isfinite(y)) and np.all(y == np.round(y))
    )
    if not integral:
        raise DataError(f"{where}: {name} must hold integer class ids")
    if y.size and (y.min() < -(2**62) or y.max() > 2**62):  # int64 would wrap
        raise DataError(
            f"{where}: labels out of range: {name} holds class ids in "
            f"[{y.min()}, {y.max()}], beyond any number of classes"
        )
    return y.astype(np.int64)


def _finish(x_train, y_train, x_test, y_test, num_classes, source, where):
    for name, x in (("x_train", x_train), ("x_test", x_test)):
        if x.dtype.kind not in "iufb":
            raise DataError(f"{where}: {name} must be numeric, got dtype {x.dtype}")
        if x.ndim < 2:
            raise DataError(
                f"{where}: {name} must have shape (examples, features...), got "
                f"shape {x.shape}"
            )
        if x.shape[0] == 0:
            raise DataError(f"{where}: {name} is empty")
        if math.prod(x.shape[1:]) == 0:
            raise DataError(
                f"{where}: {name}'s examples have shape {x.shape[1:]}: no values"
            )
    y_train = _labels("y_train", np.asarray(y_train), where)
    y_test = _labels("y_test", np.asarray(y_test), where)
    if len(x_train) != len(y_train):
        raise DataError(
            f"{where}: x_train has {len(x_train)} examples but y_train has "
            f"{len(y_train)}"
        )
    if len(x_test) != len(y_test):
        raise DataError(
            f"{where}: x_test has {len(x_test)} examples but y_test has {len(y_test)}"
        )
    if x_train.shape[1:] != x_test.shape[1:]:
        raise DataError(
            f"{where}: x_train examples have shape {x_train.shape[1:]} but x_test "
            f"examples have shape {x_test.shape[1:]}"
        )
    for name, x in (("x_train", x_train), ("x_test", x_test)):
        peak = np.abs(x).max()  # NaN if any value is
        if not np.isfinite(peak):
            raise DataError(f"{where}: {name} holds NaN or infinite values")
        if peak > np.finfo(np.float32).max:
            raise DataError(
                f"{where}: {name} holds values up to {peak:g} in magnitude, beyond "
                "float32's range (the model computes in float32)"
            )
    x_train = x_train.astype(np.float32)
    x_test = x_test.astype(np.float32)
    if num_classes is None:
        num_classes = max(int(max(y_train.max(), y_test.max())) + 1, 2)
        if num_classes > MAX_CLASSES:
            raise DataError(
                f"{where}: labels go up to {num_classes - 1}, which would make "
                f"{num_classes} classes; at most {MAX_CLASSES} are supported"
            )
    for name, y in (("y_train", y_train), ("y_test", y_test)):
        if y.min() < 0 or y.max() >= num_classes:
            raise DataError(
                f"{where}: labels out of range: {name} holds class ids in "
                f"[{int(y.min())}, {int(y.max())}] but they must be in "
                f"[0, {num_classes - 1}] (num_classes={num_classes})"
            )
    return Dataset(
        x_train,
        y_train.astype(np.int32),
        x_test,
        y_test.astype(np.int32),
        int(num_classes),
        source,
    )
