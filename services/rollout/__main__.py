"""`python -m services.rollout [engine|runner]`: a rollout engine (default) or a rollout runner."""

import sys

ROLES = ("engine", "runner")

if __name__ == "__main__":
    role = sys.argv[1] if len(sys.argv) > 1 else "engine"
    if role not in ROLES or len(sys.argv) > 2:
        sys.exit(f"usage: python -m services.rollout [{'|'.join(ROLES)}]")
    if role == "engine":
        from services.rollout.server import main
    else:
        from services.rollout.runner import main
    main()
