"""List every MoE router class of the installed transformers with its code fingerprint and replay family.

`python -m routing_replay.replay.router_codes`: one line per class (model folder, class, fingerprint, family or
-); what to run when a transformers release changes router code, before adding a fingerprint to
`replay.routers.FAMILIES`.
"""

from __future__ import annotations

import torch

from routing_replay.replay.routers import family_of, fingerprint


def main(argv=None) -> int:
    """Print each MoE router class of the installed transformers: fingerprint, family (or -)."""
    import argparse
    import importlib
    import pkgutil
    import re

    parser = argparse.ArgumentParser(prog="python -m routing_replay.replay.router_codes",
                                     description="List every MoE router class of the installed transformers with "
                                                 "its code fingerprint and the replay family that reproduces it "
                                                 "(- for none).")
    parser.parse_args(argv)
    import transformers.models as tm

    for info in sorted(pkgutil.iter_modules(tm.__path__), key=lambda i: i.name):
        try:
            mod = importlib.import_module(f"transformers.models.{info.name}.modeling_{info.name}")
        except Exception:          # not every model folder has a modeling module, or its extras are missing
            continue
        for cname, cls in sorted(vars(mod).items()):
            if (isinstance(cls, type) and cls.__module__ == mod.__name__ and issubclass(cls, torch.nn.Module)
                    and re.search(r"(Router|TopKGating|Gate)$", cname) and "Forget" not in cname):
                fam = family_of(cls)
                print(f"{info.name:24s} {cname:40s} {fingerprint(cls)} {fam.name if fam else '-'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
