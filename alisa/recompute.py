"""Moved to :mod:`alisa.storage.recompute`; kept only for alisa/profiling.py's import."""

from alisa.storage.recompute import KVRecomputer as KVRecomputer
