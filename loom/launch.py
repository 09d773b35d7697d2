"""`python -m loom.launch TORCHRUN_ARGS`: torchrun started by `loom train|verify` for a config's N local
ranks. When the ranks end with one of loom's own exit codes (a config or data error, a stalled collective),
rank 0 has already said why in one message: this exits with that code instead of torchrun's failure block."""

from __future__ import annotations

import logging
import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

from loom.exit_codes import LOOM_CODES


def main(argv: list[str]) -> int:
    # the agent's own log lines ("failed (exitcode: 4) local_rank: 1 …") would bury rank 0's one message;
    # any other failure still ends in torchrun's ChildFailedError block below
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        run(parse_args(argv))
    except ChildFailedError as e:
        _, first = e.get_first_failure()
        if first.exitcode in LOOM_CODES:
            return first.exitcode
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
