import argparse


class OneLineErrorParser(argparse.ArgumentParser):
    """Reports a bad argument on one line and exits with status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")
