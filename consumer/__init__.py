"""Consumer: accumulate routing rows per request, emit finished records to npz files and trainers.

The trainer side (TrainerClient, the npz readers) is importable without loading the consumer service: the
service's names are resolved on first use.
"""

from importlib import import_module

from routing_replay.consumer.client import (FetchTimeout, RecordEvicted, RecordsNotServed, RecordUnknown,
                                           RecordUnreadable, TrainerClient)
from routing_replay.consumer.npz import (NpzWriter, UnreadableRecord, iter_records, load_records, read_record,
                                        record_files, safe_filename, write_record)

_LAZY = {"Accumulator": "accumulator", "AccumulatorStats": "accumulator", "Consumer": "service",
         "ConsumerConfig": "config", "RecordStore": "store", "TrainerService": "trainer_service"}

__all__ = ["Accumulator", "AccumulatorStats", "Consumer", "ConsumerConfig", "FetchTimeout", "NpzWriter",
           "RecordEvicted", "RecordStore", "RecordUnknown", "RecordUnreadable", "RecordsNotServed", "TrainerClient", "TrainerService",
           "UnreadableRecord", "iter_records", "load_records", "read_record",
           "record_files", "safe_filename", "write_record"]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
