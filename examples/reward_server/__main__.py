"""`python -m examples.reward_server --port N`: the partial-credit reward server."""

from examples.reward_server.server import main

if __name__ == "__main__":
    main()
