"""The dashboard in a real browser (Debian's headless Chromium, driven by Selenium) against a running
stack with a token: the page asks for the token, a spec submitted from its form appears in the job
list, the job's reward curve gains points as steps come in over the event stream, the cluster panel
shows the engine and the trainer, and the cancel button ends the job (CANCELLED on the page)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from services.stack import Stack, StackConfig

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
TOKEN = "dashboard-test-token-0123456789"
WAIT_S = 240.0
"""Deadline of each wait on the page (a step of the addition job takes seconds on a CPU)."""

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


def _browser_missing() -> str:
    missing = [path for path in (CHROMIUM, CHROMEDRIVER) if not shutil.which(path)]
    if not missing:
        return ""
    message = f"{' and '.join(missing)} not found: apt-get install -y chromium chromium-driver"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"the dashboard test needs a browser: {message}")
    return message


@pytest.fixture
def driver(tmp_path: Path) -> Iterator[object]:
    missing = _browser_missing()
    if missing:
        pytest.skip(missing)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    # No background connections: the machine's network is closed and Chromium would retry them.
    quiet = ("--disable-background-networking", "--disable-component-update", "--disable-sync")
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1400,1100",
                 "--no-first-run", "--disable-quic", *quiet):  # fmt: skip
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path / 'chromium'}")
    browser = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    browser.set_page_load_timeout(60)
    try:
        yield browser
    finally:
        browser.quit()


def test_dashboard_submits_follows_and_cancels_a_job(driver, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ready
    from selenium.webdriver.support.wait import WebDriverWait

    from services.models import resolve_model_path

    resolve_model_path("builtin:addition")  # built once and cached, outside the page's waits
    spec = yaml.safe_load((ROOT / "examples" / "addition.yaml").read_text())
    spec["name"] = "e2e-dashboard"
    spec["trainer"] |= {"steps": 200, "checkpoint_dir": str(tmp_path / "runs")}
    spec["eval"] = {"every_steps": 5, "num_prompts": 32}
    config = StackConfig(log_dir=tmp_path / "logs", api_port=0, router_port=0, engine_port=0,
                         reward_port=0, trainer_port=0, runner_port=0, engine_metrics_port=0,
                         extra_env={"VERST_API_TOKEN": TOKEN})  # fmt: skip
    wait = WebDriverWait(driver, WAIT_S)
    with Stack(config) as stack:
        driver.get(f"{stack.api_url}/")
        token = wait.until(ready.visibility_of_element_located((By.ID, "token-input")))  # the list got a 401
        token.send_keys(TOKEN)
        driver.find_element(By.ID, "token-save").click()
        wait.until(lambda d: "jobs" in d.find_element(By.ID, "status").text)

        driver.find_element(By.ID, "spec").send_keys(json.dumps(spec))
        driver.find_element(By.ID, "submit").click()
        wait.until(lambda d: "#/job/" in d.current_url)
        job_id = driver.current_url.split("#/job/", 1)[1]

        reward = "figure[data-chart='reward'] canvas"
        points = lambda d: int(d.find_element(By.CSS_SELECTOR, reward).get_attribute("data-points"))  # noqa: E731
        wait.until(lambda d: points(d) >= 1)
        seen = points(driver)
        wait.until(lambda d: points(d) > seen)  # a later step's metrics event drew another point
        wait.until(lambda d: "RUNNING" in d.find_element(By.ID, "job-state").text)

        driver.get(f"{stack.api_url}/#/")  # the list and the cluster, read with the stored token
        wait.until(ready.presence_of_element_located((By.CSS_SELECTOR, f"tr[data-job='{job_id}']")))
        wait.until(ready.presence_of_element_located((By.CSS_SELECTOR, f"#cluster tr[data-job='{job_id}']")))
        assert driver.find_elements(By.CSS_SELECTOR, "#cluster tr[data-kind='engine']")

        driver.get(f"{stack.api_url}/#/job/{job_id}")
        wait.until(lambda d: points(d) > seen)
        screenshot = tmp_path / "dashboard.png"
        driver.save_screenshot(str(screenshot))
        assert screenshot.read_bytes().startswith(b"\x89PNG")
        if os.environ.get("VERST_UPDATE_SCREENSHOT"):  # refresh the README's picture
            shutil.copyfile(screenshot, ROOT / "docs" / "dashboard.png")

        driver.find_element(By.ID, "cancel").click()
        state = driver.find_element(By.ID, "job-state")
        wait.until(lambda d: state.get_attribute("data-state") == "JOB_STATE_CANCELLED")
        assert driver.find_element(By.ID, "cancel").get_attribute("disabled") is not None
