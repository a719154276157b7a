"""Sharded safetensors checkpoints that reshard on load, save atomically and asynchronously, and never unpickle.

Public API:

* :class:`ShardedTensor` — this rank's piece (block or flat range of a block) of a global tensor;
* :class:`CheckpointSaver` — collective, atomic, optionally asynchronous save into
  ``save_dir/iter_{N:07d}`` with a ``latest`` pointer and retention; the object owns the saves
  still running, their staging buffers and the coordination process group (``with`` block /
  ``close()``); :class:`SaveHandle` — one save;
* :func:`save_checkpoint` / :func:`wait_for_snapshot` / :func:`finalize` /
  :func:`release_staging_buffers` — the same through one default saver (the convenience path);
* :func:`load_checkpoint` — fill a state template from a checkpoint saved at any layout;
* :func:`inspect_checkpoint` — describe (and verify) a checkpoint without loading it;
* :func:`write_hf_safetensors` / :func:`iter_hf_safetensors` — streaming Hugging Face style
  sharded safetensors directories;
* :class:`StreamingCheckpointWriter` / :class:`CheckpointReader` — write a checkpoint one tensor
  at a time, read any checkpoint one tensor at a time (conversions larger than memory);
  :class:`HFSafetensorsReader` — random access to a Hugging Face directory's tensors;
* :class:`CheckpointError` — every load/save failure, naming the file and tensor at fault.
"""

__version__ = "0.1.0"

from mg_ckpt.errors import CheckpointError
from mg_ckpt.hf import HFSafetensorsReader, iter_hf_safetensors, read_hf_index, write_hf_safetensors
from mg_ckpt.inspect import CheckpointReport, inspect_checkpoint
from mg_ckpt.load import load_checkpoint
from mg_ckpt.metadata import checkpoint_dir, latest_iteration, list_checkpoints
from mg_ckpt.save import (
    CheckpointSaver,
    SaveHandle,
    finalize,
    release_staging_buffers,
    save_checkpoint,
    wait_for_snapshot,
)
from mg_ckpt.sharded import ShardedTensor
from mg_ckpt.stream import CheckpointReader, StreamingCheckpointWriter

__all__ = [
    "CheckpointError",
    "CheckpointReader",
    "CheckpointReport",
    "CheckpointSaver",
    "HFSafetensorsReader",
    "SaveHandle",
    "ShardedTensor",
    "StreamingCheckpointWriter",
    "checkpoint_dir",
    "finalize",
    "inspect_checkpoint",
    "iter_hf_safetensors",
    "latest_iteration",
    "list_checkpoints",
    "load_checkpoint",
    "read_hf_index",
    "release_staging_buffers",
    "save_checkpoint",
    "wait_for_snapshot",
    "write_hf_safetensors",
]
