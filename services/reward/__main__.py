"""`python -m services.reward`: the reward and tool service."""

from services.reward.server import main

if __name__ == "__main__":
    main()
