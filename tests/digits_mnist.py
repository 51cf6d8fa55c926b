"""MNIST-shaped data without a download: scikit-learn's 8×8 digits, upscaled to 28×28, in libsvm format.

horovod's Spark MNIST examples read ``<data-dir>/mnist.bz2`` (libsvm, 784 features 0–255) and download
it only when it is missing, so writing this file there runs them unchanged. Each of the 1,797 digits
comes in ``copies`` versions shifted by up to two pixels, so that there are enough rows to learn from.
"""

from __future__ import annotations

import bz2
from pathlib import Path

import numpy as np


def images(copies: int = 4, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(n, 28, 28) pixels 0–255 and (n,) labels 0–9."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    rng = np.random.default_rng(seed)
    big = np.kron(digits.images, np.ones((3, 3))) * (255 / 16)  # 24×24
    out, labels = [], []
    for _ in range(copies):
        dy, dx = rng.integers(0, 5, size=2)  # a 28×28 canvas: 4 pixels of room
        canvas = np.zeros((len(big), 28, 28))
        canvas[:, dy:dy + 24, dx:dx + 24] = big
        out.append(canvas)
        labels.append(digits.target)
    return np.concatenate(out).round(), np.concatenate(labels)


# MNIST's mean pixel, of 255. The digits drawn 3 pixels wide are brighter on average (57): raw, as
# horovod's examples feed them, their first SGD steps sometimes threw every ReLU dead (loss stuck at
# ln 10, accuracy 0.1). Scaled to MNIST's mean, the inputs are as bright as the examples expect.
MNIST_MEAN_PIXEL = 33.3


def write_libsvm(path: Path, copies: int = 4, seed: int = 0) -> Path:
    pixels, labels = images(copies, seed)
    pixels = (pixels * (MNIST_MEAN_PIXEL / pixels.mean())).round()
    lines = []
    for image, label in zip(pixels.reshape(len(pixels), -1), labels):
        nonzero = np.flatnonzero(image)
        lines.append(" ".join([str(int(label)), *(f"{i + 1}:{int(image[i])}" for i in nonzero)]))
    path.write_bytes(bz2.compress(("\n".join(lines) + "\n").encode()))
    return path
