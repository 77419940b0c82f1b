"""Bytes on disk and elsewhere: the checksummed blob format, atomic writes, prefix stores."""
