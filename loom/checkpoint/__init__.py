"""Checkpoints: sharded (every rank its shards, any layout reads them: sharded.py) in crash-safe folders
(folders.py), read one tensor at a time for export and `loom eval` (read.py)."""
