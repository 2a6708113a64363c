"""`python -m services.router`: the router in front of the rollout engines."""

from services.common.grpc_server import main
from services.router.config import RouterSettings
from services.router.server import register

if __name__ == "__main__":
    main(RouterSettings, register)
