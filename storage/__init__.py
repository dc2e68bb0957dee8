"""Region-feature storage: the record type, the LMDB store, and TSV/HDF5 conversion."""

from storage.environment import StoreDamagedError, StoreOpenError
from storage.errors import BadInputError, CorruptRecordError, StoreError, StoreFormatError
from storage.reader import FeatureReader
from storage.records import RegionFeatures
from storage.validate import BadRecordError
from storage.writer import FeatureWriter

__all__ = [
    "BadInputError",
    "BadRecordError",
    "CorruptRecordError",
    "FeatureReader",
    "FeatureWriter",
    "RegionFeatures",
    "StoreDamagedError",
    "StoreError",
    "StoreFormatError",
    "StoreOpenError",
]
