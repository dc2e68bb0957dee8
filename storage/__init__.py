"""Region-feature storage: the record type, the LMDB store, and TSV/HDF5 conversion."""

from storage.records import RegionFeatures

__all__ = ["RegionFeatures"]
