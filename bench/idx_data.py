"""Fashion-MNIST's IDX files (plain or .gz) as numpy arrays, for the Python
peers of bench/bench_train.c (bench/torch_train.py, bench/tf_train.py)."""
import gzip
import os

import numpy as np


def read_idx(path):
    """An IDX file (plain or .gz) as a numpy array."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    dtype_code, rank = data[2], data[3]
    if data[0] != 0 or data[1] != 0 or dtype_code != 0x08:
        raise ValueError(f"{path}: not an unsigned-byte IDX file")
    dims = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(rank)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * rank).reshape(dims)


def find(data_dir, name):
    for candidate in (name + ".gz", name):
        path = os.path.join(data_dir, candidate)
        if os.path.exists(path):
            return path
    raise FileNotFoundError(os.path.join(data_dir, name + "[.gz]"))
