"""`python -m services.trainer`: the DeepSpeed trainer."""

from services.trainer.server import main

if __name__ == "__main__":
    main()
