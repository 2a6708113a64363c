"""`python -m services.runner`: the episode runner (prompt tasks in, scored trajectories out)."""

from services.runner.server import main

if __name__ == "__main__":
    main()
