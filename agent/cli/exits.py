"""The one exit-code table of every ``tfimage`` subcommand, in the spirit of
sysexits(3): a script tells what went wrong from the status alone.

    status  name         meaning
    ------  -----------  ------------------------------------------------------
      0     OK           done
      1     STATE        it ran and found a problem in this node's state: a bad
                         cache entry (cache verify), a kept image not fetched
                         (cache warm), a GPU that still fails (gpu resume),
                         warnings (doctor, gpu check)
      2     INPUT        what it was given is wrong: the config, the
                         credentials, a reference, a file, an option's value, a
                         target that names nothing or more than one thing; for
                         doctor and gpu check: an error or a drain-class fault
      3     NOT_READY    the image or the runtime could not be had: the
                         registry, verification, the cache's disk, a mount
     64     USAGE        the command line itself is not understood (EX_USAGE)
     70     INTERNAL     a bug in tfimage (EX_SOFTWARE); the line names it
    130     INTERRUPTED  stopped with Ctrl-C

errors.py gives each exception its status; docs/cli.md prints this table, and a
test holds the two together.
"""

from __future__ import annotations

OK = 0
STATE = 1
INPUT = 2
NOT_READY = 3
USAGE = 64
INTERNAL = 70
INTERRUPTED = 130

TABLE: tuple[tuple[int, str, str], ...] = (
    (OK, "OK", "done"),
    (STATE, "STATE", "it ran and found a problem in this node's state"),
    (INPUT, "INPUT", "what it was given is wrong: config, credentials, reference, file, value"),
    (NOT_READY, "NOT_READY", "the image or the runtime could not be had"),
    (USAGE, "USAGE", "the command line is not understood"),
    (INTERNAL, "INTERNAL", "a bug in tfimage"),
    (INTERRUPTED, "INTERRUPTED", "stopped with Ctrl-C"),
)

EPILOG = (
    "Exit status: 0 ok; 1 a problem found in this node's state; 2 bad input (config, "
    "credentials, reference, file, value); 3 image or runtime not ready; 64 usage; "
    "70 internal error. With --json an error is also a JSON object on stdout."
)
