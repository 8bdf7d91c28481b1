"""Atomic, verifiable checkpoints, in one of two formats, written in the background where that pays.

One process and DDP keep the single-file format (readable without torch.distributed, and DCP is no faster
there); FSDP writes torch.distributed.checkpoint shards. Layout, reasons and measurements: docs/checkpoints.md.

* :mod:`.store`: the on-disk format: layout, atomic write and commit, crash recovery, rotation, verification,
  finding the newest valid checkpoint, the allow-list reader of DCP's index;
* :mod:`.sharded`: DCP state dicts of a (possibly FSDP) model and optimizer, saved and loaded on any world size;
* :mod:`.restore`: reading a checkpoint back into a run (weights of either format, the trainer state); never
  unpickles code (``weights_only=True``);
* :mod:`.staging`: host buffers the background writers copy the state into, kept for the whole run;
* :mod:`.savers`: :class:`~.savers.FileSaver` and :class:`~.savers.ShardedSaver`, whose saves block training
  only for the copy into those buffers.

Each module imports only those listed above it.
"""
