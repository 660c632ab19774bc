"""``python -m shardlang``: the command line (see `shardlang.cli`)."""

import sys

from shardlang.cli import main

if __name__ == "__main__":  # the launcher's spawned ranks import this module as __mp_main__: do not run again
    sys.exit(main())
