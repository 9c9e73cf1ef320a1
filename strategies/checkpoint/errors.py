"""The error of a checkpoint that cannot or may not be read."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be read: incomplete, corrupted (a file fails its size or checksum check), of
    another format version, not a checkpoint, or holding pickled objects outside what loading admits without
    `trust_pickled=True`. A `ValueError`."""
