"""Consumer: accumulate routing rows per request, emit finished records to npz files and trainers."""

from consumer.accumulator import Accumulator, AccumulatorStats
from consumer.client import RecordEvicted, TrainerClient
from consumer.npz import NpzWriter, iter_records, load_records, read_record, safe_filename, write_record
from consumer.service import Consumer
from consumer.store import RecordStore

__all__ = ["Accumulator", "AccumulatorStats", "Consumer", "NpzWriter", "RecordEvicted", "RecordStore",
           "TrainerClient", "iter_records", "load_records", "read_record", "safe_filename", "write_record"]
