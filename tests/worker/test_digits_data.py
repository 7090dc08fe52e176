"""The digits are read without scikit-learn, and are exactly what scikit-learn gives."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import torch

from worker.workloads import digits

REPO = Path(__file__).resolve().parents[2]


def _sklearn_reference() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The digits as this module loaded them before: scikit-learn's loader and seeded split."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    y = y.astype(np.int64)
    x_train, x_val, y_train, y_val = train_test_split(
        x, y, test_size=digits.N_VAL, stratify=y, random_state=digits.SPLIT_SEED
    )
    return x_train, y_train, x_val, y_val


def test_digits_are_bit_identical_to_scikit_learns_split() -> None:
    digits.digits_splits.cache_clear()
    train, val = digits.digits_splits("cpu")
    want = _sklearn_reference()
    got = (train.x, train.y, val.x, val.y)
    for name, g, w in zip(("x_train", "y_train", "x_val", "y_val"), got, want, strict=True):
        assert isinstance(g, torch.Tensor)
        assert g.numpy().dtype == w.dtype, name
        assert g.shape == w.shape, name
        assert g.numpy().tobytes() == w.tobytes(), f"{name} differs from scikit-learn's"
    assert train.x.shape == (digits.N_TRAIN, 64) and val.x.shape == (digits.N_VAL, 64)


def test_table_is_scikit_learns_digits() -> None:
    from sklearn.datasets import load_digits

    table = digits.load_digits_table()
    x, y = load_digits(return_X_y=True)
    assert np.array_equal(table[:, :-1], x) and np.array_equal(table[:, -1], y)


def test_loading_the_digits_does_not_import_scikit_learn() -> None:
    code = textwrap.dedent(
        """
        import sys
        from worker.workloads.digits import digits_splits
        train, val = digits_splits("cpu")
        assert len(train.x) == 1437 and len(val.x) == 360
        print("sklearn" in sys.modules)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False", out.stdout + out.stderr
