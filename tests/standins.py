"""Stand-ins shared by several test files for what an engine hands the producer."""

from __future__ import annotations


class Slot:
    """Deferred rows in a ring slot: `result()` is the array, and the slot is overwritten (-7) once released, so a
    producer that keeps reading it after `release()` sends wrong rows."""

    def __init__(self, arr):
        self.arr, self.shape, self.dtype, self.released = arr, arr.shape, arr.dtype, 0

    def result(self):
        return self.arr

    def release(self):
        self.released += 1
        self.arr[...] = -7
