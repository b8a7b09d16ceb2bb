"""``python -m autotp ...``: the same command line as the ``autotp`` console script."""

from autotp.cli import run

if __name__ == "__main__":
    run()
