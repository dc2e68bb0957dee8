"""Region-feature storage: the record type, the LMDB store, and TSV/HDF5 conversion."""

from storage.errors import BadInputError, CorruptRecordError, StoreError, StoreFormatError
from storage.reader import FeatureReader
from storage.records import RegionFeatures
from storage.writer import FeatureWriter

__all__ = [
    "BadInputError",
    "CorruptRecordError",
    "FeatureReader",
    "FeatureWriter",
    "RegionFeatures",
    "StoreError",
    "StoreFormatError",
]
