"""Checkpoints: the engine's state as a dict of host arrays (state_dict:
the formats and the saving side; load: a saved dict into an engine;
expected and outline: what a checkpoint must look like to load, and how
one differs; engine_parts: where the engine keeps what is saved), streamed
a span at a time between the live state and the files (spans: reading the
live state; saved_leaf: a saved leaf into the engine; handler: orbax's type
handler; checksums: the CRC32 of each chunk, taken as it is written and
checked as it is read), and orbax folders on disk (files: save, restore,
read the masters; disk: what a save meets on a disk that refuses it).

`jzo.checkpoint.open_manager`, `save`, `restore` and the rest of files'
public names are this package's."""

from jzo.checkpoint.checksums import ChecksumError
from jzo.checkpoint.disk import os_error_text
from jzo.checkpoint.files import (SAVE_HOST_BYTES, CheckpointError, CheckpointWriteError,
                                  UnreadableCheckpointError, folder_of, masters_in_shapes,
                                  open_manager, read_masters, release_freed_memory, restore,
                                  restore_readable, save, saved_bytes)
from jzo.checkpoint.state_dict import live_masters

__all__ = ["SAVE_HOST_BYTES", "CheckpointError", "CheckpointWriteError", "ChecksumError",
           "UnreadableCheckpointError", "folder_of", "live_masters", "masters_in_shapes",
           "open_manager", "os_error_text", "read_masters", "release_freed_memory", "restore",
           "restore_readable", "save", "saved_bytes"]
