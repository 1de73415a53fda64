"""The error a user's bad flag or flag combination raises (the CLI prints it in one line, exit 2)."""

import argparse


class ConfigError(ValueError):
    """A bad flag or flag combination; the message names the flag and the fix."""


# torchrun stops every worker as soon as one exits with an error. The message is printed by rank 0
# only (once, not once per rank), so the other ranks wait this long before exiting: otherwise a
# fast rank 1 can get rank 0 killed before it has printed anything.
PEER_EXIT_GRACE_S = 5.0


def exit_with_message(message: str, code: int) -> None:
    """Exit with ``code``; ``message`` printed to stderr by global rank 0 only (see above)."""
    import os
    import sys
    import time

    if int(os.environ.get("RANK", "0")) == 0:
        print(message, file=sys.stderr, flush=True)
    else:
        time.sleep(PEER_EXIT_GRACE_S)
    sys.exit(code)


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors (unknown flag, invalid choice, bad value, missing value) are
    one line and exit code 2, without the usage block (``--help`` shows that)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (--help lists the flags)\n")
