"""``python -m hetfed_example.write_folder OUT [--per-class N]``: write a Fashion-MNIST image tree for hetfed.

The tree is ``OUT/train/<class>/<index>.png`` and ``OUT/test/<class>/<index>.png``, read by the data factory
``hetfed_example.data:fashion_folder`` or by hetfed's built-in ``imagefolder`` dataset.
"""

from __future__ import annotations

import argparse
import sys

from hetfed_example.data import write_fashion_folder


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, write the tree, print what was written."""
    parser = argparse.ArgumentParser(prog="python -m hetfed_example.write_folder", description=__doc__.split("\n")[0])
    parser.add_argument("out", metavar="OUT", help="directory to write train/ and test/ into")
    parser.add_argument("--per-class", type=int, default=None, metavar="N",
                        help="first N images of each class of each split (default: all, 60,000 + 10,000)")
    parser.add_argument("--source", default=None, metavar="DIR",
                        help="directory of the idx files (default: $HETFED_FASHION_MNIST_DIR, else "
                             "/usr/share/datasets/fashion-mnist)")
    args = parser.parse_args(argv)
    try:
        written = write_fashion_folder(args.out, per_class=args.per_class, source=args.source)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {written['train']} training and {written['test']} test images under {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
