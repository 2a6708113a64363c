"""`python -m services.router`: the router in front of the rollout engines."""

from services.router.server import main

if __name__ == "__main__":
    main()
