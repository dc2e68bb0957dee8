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
