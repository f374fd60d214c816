import argparse


class OneLineErrorParser(argparse.ArgumentParser):
    """Reports a bad argument on one line and exits with status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def int_list(text: str) -> list[int]:
    """An argument of comma-separated integers, e.g. "8,16,30"."""
    return [int(item) for item in text.split(",") if item]


def str_list(text: str) -> list[str]:
    """An argument of comma-separated names, e.g. "per-request,staggered"."""
    return [item for item in text.split(",") if item]


def token_range(text: str) -> tuple[int, int]:
    """An argument of two comma-separated integers, MIN,MAX, e.g. "2000,3000"."""
    low, high = (int(part) for part in text.split(","))
    return low, high


def float_list(text: str) -> list[float]:
    """An argument of comma-separated numbers, e.g. "0,0.7,1.0"."""
    return [float(item) for item in text.split(",") if item]
