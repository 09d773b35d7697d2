"""The exit codes of `loom` (docs/errors.md lists them): a script or scheduler can tell a bad config from bad data
from a stalled collective without reading the message."""

OK = 0
FAILED = 1  # verify found a difference (or its reference was not finite); an unexpected error
CONFIG_ERROR = 2  # the config (or a command's arguments) cannot run: nothing was started
STALLED = 3  # a collective timed out or lost a peer
DATA_ERROR = 4  # a bad sample (data.on_bad_sample = "error"): file:line and why, from rank 0

LOOM_CODES = (CONFIG_ERROR, STALLED, DATA_ERROR)  # the ones a rank reports itself, in one clean message
