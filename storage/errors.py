"""Errors raised by the feature store: each names the file or record and says what to do."""

from __future__ import annotations


class StoreError(Exception):
    """Base class of every feature-store error."""


class StoreFormatError(StoreError, ValueError):
    """A path is not a feature store, or one this version of xmodal cannot read."""


class CorruptRecordError(StoreError, ValueError):
    """A stored value does not decode or does not match its checksum."""


class BadInputError(StoreError, ValueError):
    """A line or row of an import source is malformed; names the source, the line or row and the id."""


class DroppedInput(BadInputError):
    """Something an import source holds that no record carries (ids naming no row, label datasets it
    lacks): said in the summary, or refused with `strict`. `count`: how many ids, `what`: of what."""

    def __init__(self, message: str, count: int = 0, what: str = ""):
        super().__init__(message)
        self.count = count
        self.what = what
