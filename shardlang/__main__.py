"""``python -m shardlang``: the command line (see `shardlang.cli`)."""

from shardlang.cli import run_program

if __name__ == "__main__":  # the launcher's spawned ranks import this module as __mp_main__: do not run again
    run_program()
