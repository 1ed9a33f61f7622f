"""Container health check: exit 0 if a TCP port accepts connections (`tcp HOST:PORT`) or a URL answers 200
(`http URL`), 1 otherwise. Used by docker-compose.yml; standard library only, so it runs in every image."""

import socket
import sys
import urllib.request


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("tcp", "http"):
        print("usage: healthcheck.py tcp HOST:PORT | http URL", file=sys.stderr)
        return 2
    kind, target = argv
    try:
        if kind == "tcp":
            host, _, port = target.rpartition(":")
            with socket.create_connection((host, int(port)), timeout=3):
                return 0
        with urllib.request.urlopen(target, timeout=5) as r:
            return 0 if r.status == 200 else 1
    except (OSError, ValueError) as e:
        print(f"unhealthy: {kind} {target}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
