"""`python -m services.controller`: the job controller as its own process (gRPC health, /metrics)."""

from services.controller.server import main

if __name__ == "__main__":
    main()
