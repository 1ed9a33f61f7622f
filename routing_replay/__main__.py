"""`python -m routing_replay`: the command line (same as the `routing-replay` script)."""

from routing_replay.apps.cli import main

raise SystemExit(main())
