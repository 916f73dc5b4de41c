"""Named arrays in one .npz file: a step's inputs, a run's reference outputs. Any name is
safe (names are stored apart from the arrays), and a saved file can be read one array at a
time (`saved_arrays`)."""
from __future__ import annotations

import os
from typing import Iterator

import numpy as np

NAMES_KEY = "__graphopt_input_names__"


def save_arrays(path: str | os.PathLike, arrays: dict[str, np.ndarray]) -> None:
    """Save named arrays as .npz (names stored separately, so any name is safe)."""
    names = list(arrays)
    values = [np.asarray(arrays[n]) for n in names]
    with open(path, "wb") as f:
        np.savez(f, *values, **{NAMES_KEY: np.array(names, dtype=np.str_)})


def load_arrays(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Load named arrays written by :func:`save_arrays` (or any plain .npz: keys are names)."""
    with np.load(path, allow_pickle=False) as z:
        if NAMES_KEY in z.files:
            names = [str(n) for n in z[NAMES_KEY]]
            return {n: np.ascontiguousarray(z[f"arr_{i}"]) for i, n in enumerate(names)}
        return {k: np.ascontiguousarray(z[k]) for k in z.files}


def saved_arrays(path: str | os.PathLike) -> Iterator[tuple[str, np.ndarray]]:
    """(name, array) of a file written by :func:`save_arrays`, one array in memory at a time."""
    with np.load(path, allow_pickle=False) as z:
        if NAMES_KEY in z.files:
            for i, name in enumerate(str(n) for n in z[NAMES_KEY]):
                yield name, z[f"arr_{i}"]
        else:
            for name in z.files:
                yield name, z[name]
