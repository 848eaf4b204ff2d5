"""``python -m fxrec`` (and the ``fxrec`` console script): the command-line entry point."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch ``fxrec <command> ...``; today the only command is ``bench``."""
    from fxrec.bench.cli import build_parser, run_cli

    parser = build_parser()
    args, extra = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    if extra:  # with the command's usage, not the top level's
        getattr(args, "command_parser", parser).error(f"unrecognized arguments: {' '.join(extra)}")
    return run_cli(args, parser)


if __name__ == "__main__":
    sys.exit(main())
