"""`python -m services.reward`: the reward and tool service."""

from services.common.grpc_server import main
from services.reward.config import RewardSettings
from services.reward.server import register

if __name__ == "__main__":
    main(RewardSettings, register)
