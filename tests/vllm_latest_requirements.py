"""Print the requirements of the installed `vllm` distribution that apply here, one a line, for `pip install -r`.

`make check-vllm-latest` installs vLLM's CUDA wheel with `--no-deps` and then its requirements from this list, so
that a pin the package registry does not serve (vLLM 0.34.0 pins flashinfer-python==0.7.3, which PyPI lacks) can
be left out by name instead of failing the whole install. Usage:

    python tests/vllm_latest_requirements.py [--skip NAME==VERSION ...]

A requirement is left out only when its name and specifier equal a --skip entry exactly (so a later release that
pins a version PyPI has gets it installed); each one left out is named on stderr. Requirements behind extras, and
those whose environment marker is false here, are left out as pip would.
"""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import PackageNotFoundError, requires

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name


def _key(req: Requirement) -> tuple:
    return canonicalize_name(req.name), str(req.specifier)


def applicable(lines: list[str], skip: list[str]) -> tuple[list[str], list[str]]:
    """(requirements to install, requirements left out by `skip`) of a distribution's Requires-Dist `lines`."""
    skipped_keys = {_key(Requirement(s)) for s in skip}
    keep, left_out = [], []
    for line in lines:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if _key(req) in skipped_keys:
            left_out.append(line)
            continue
        req.marker = None
        keep.append(str(req))
    return keep, left_out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dist", default="vllm", help="installed distribution whose requirements to print")
    ap.add_argument("--skip", action="append", default=[], metavar="NAME==VERSION",
                    help="a requirement to leave out (exact name and specifier); repeatable")
    args = ap.parse_args(argv)
    try:
        lines = requires(args.dist) or []
    except PackageNotFoundError:
        print(f"error: distribution {args.dist!r} is not installed", file=sys.stderr)
        return 2
    try:
        keep, left_out = applicable(lines, args.skip)
    except InvalidRequirement as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for line in left_out:
        print(f"{args.dist}: leaving out {line} (not served by the package registry)", file=sys.stderr)
    print("\n".join(keep))
    return 0


if __name__ == "__main__":
    sys.exit(main())
