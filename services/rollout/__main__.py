"""`python -m services.rollout`: a rollout engine (the torch backend, or SGLang servers)."""

import sys

from services.rollout.server import main

if __name__ == "__main__":
    if len(sys.argv) > 1:
        sys.exit("usage: python -m services.rollout (the episode runner is python -m services.runner)")
    main()
