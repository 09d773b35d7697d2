"""Checkpoints: sharded (every rank its shards, any layout reads them: sharded.py) in crash-safe folders
(folders.py), and the gathered one-folder form export and one-process evaluation read (full.py)."""
