"""`python -m services.api`: the REST api, served by uvicorn; it exits with status 3 once it has been
unhealthy for VERST_API_UNHEALTHY_EXIT_S (services/api/health.py), so that its supervisor restarts it."""

import logging
import signal
from types import FrameType

import uvicorn

from services.api.config import ApiSettings
from services.api.server import create_app
from services.common.settings import load_settings, redis_target, setup_logging
from services.controller.config import ControllerSettings


def _after_shutdown(signum: int, frame: FrameType | None) -> None:
    # uvicorn shuts down gracefully on SIGTERM/SIGINT, then re-raises the signal to the
    # handler it found; this one makes that a clean exit (status 0) instead of a kill.
    logging.getLogger("services.api").info("api stopped (%s)", signal.Signals(signum).name)


if __name__ == "__main__":
    settings = load_settings(ApiSettings)
    setup_logging(settings.service_name, settings.log_level)
    redis_target(settings)  # exit now with a clear message rather than in the app's startup
    controller = load_settings(ControllerSettings) if settings.controller else None
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _after_shutdown)
    uvicorn.run(
        create_app(settings, exit_when_unhealthy=True, controller=controller),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        timeout_graceful_shutdown=int(settings.shutdown_grace_s),
    )
