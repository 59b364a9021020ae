"""The one exception type the data pipeline raises for bad input (files, hashes, corpora)."""

from __future__ import annotations


class DataError(Exception):
    """A problem with the data on disk or in a source, reported as one line naming the file or source."""
