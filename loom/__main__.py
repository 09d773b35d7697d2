import os
import sys

from loom.cli import main

code = main()
if "WORLD_SIZE" in os.environ:
    # a torchrun rank: its process group is already destroyed; skip interpreter teardown, which sometimes
    # aborts ("terminate called without an active exception") after functional collectives
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
raise SystemExit(code)
