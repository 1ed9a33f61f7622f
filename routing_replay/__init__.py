"""routing-replay: stream MoE routing decisions from inference engines to RL trainers.

One import name; the subpackages are the layers, each imports only the ones below it:

    routing_replay.apps       CLI, demo, embedded pipeline, synthetic engine, oracle, tiny models   (applications)
    routing_replay.engines    vLLM plugin, HF transformers adapter                                  (engines)
    routing_replay.capture → producer → broker → consumer → replay                                  (stages)
    routing_replay.protocol   wire format, ids, security, shared loop helpers                       (floor)

Importing this package imports nothing else.

From a source checkout that is only on sys.path, not installed (a bare GPU host, `python -c` in the checkout), the
layer folders sit beside this one, where setup.py maps them from; the package path then includes the checkout, so
`routing_replay.X` is the folder X there too. Installed (wheel or editable) this adds nothing that is used.
"""

__version__ = "0.1.0"


def _checkout_layers() -> None:
    import os

    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    if not os.path.isdir(os.path.join(here, "protocol")) and os.path.isfile(os.path.join(root, "setup.py")) \
            and os.path.isfile(os.path.join(root, "protocol", "__init__.py")):
        __path__.append(root)


_checkout_layers()
del _checkout_layers
