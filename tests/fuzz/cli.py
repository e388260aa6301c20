"""What every fuzzer here shares at its edges: the one-line verdict of a seed and the command line
`python -m tests.fuzz.NAME FIRST_SEED COUNT`."""
import sys


def verdict(seed: int, bad: list, case) -> str:
    """'seed N OK', or 'seed N FAIL' with the first differences and the drawn case to reproduce it."""
    return f"seed {seed} OK" if not bad else f"seed {seed} FAIL {'; '.join(bad[:6])}\n  cfg {case}"


def main(check) -> None:
    first, count = int(sys.argv[1]), int(sys.argv[2])
    for seed in range(first, first + count):
        print(check(seed), flush=True)
