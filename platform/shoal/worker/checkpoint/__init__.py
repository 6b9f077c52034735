"""Checkpoints: `format` (what a checkpoint directory holds, written and read with DCP),
`state` (the trainer's own state in it) and `saver` (when and how the worker saves and
restores). Import the submodule you need: the driver lists checkpoints through `format`
without loading the worker's engine."""
