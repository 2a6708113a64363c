"""`python -m services.trainer`: the DeepSpeed trainer."""

from services.common.grpc_server import main
from services.trainer.config import TrainerSettings
from services.trainer.server import register

if __name__ == "__main__":
    main(TrainerSettings, register)
