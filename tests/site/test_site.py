"""The documentation site as a reader sees it: built with ``mkdocs build --strict`` and opened in
headless chromium (Debian's, through chromium-driver and Selenium), served over HTTP.

The home page has the site's title, the navigation users look for (Getting started, Concepts,
How-to guides, Reference, Operations, Performance) and a highlighted Python example; the API
reference page renders ``jobq.enqueue`` from its docstring with its signature; the CLI reference
shows every subcommand's ``--help``. ``nox -s docs`` runs this file after the build (it is not
part of the conformance suite: it needs the docs tools). CI (CI set) fails when mkdocs, chromium
or its driver is missing; elsewhere the test is skipped, saying what to install.
"""

from __future__ import annotations

import functools
import http.server
import os
import pathlib
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
DRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"


def _missing() -> str | None:
    for module, hint in (("mkdocs", "pip install mkdocs mkdocs-material mkdocstrings-python"),
                         ("selenium", "pip install -e '.[test]'")):
        try:
            __import__(module)
        except ImportError:
            return f"{module} is not installed ({hint})"
    for path in (CHROMIUM, DRIVER):
        if not os.access(path, os.X_OK):
            return f"{path} is missing (apt-get install chromium chromium-driver)"
    return None


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The site, built strictly into a temporary directory and served on a free port; its URL."""
    missing = _missing()
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"the docs site's browser test must run in CI: {missing}")
        pytest.skip(f"cannot build and open the site: {missing}")
    out = tmp_path_factory.mktemp("site")
    build = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                           capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert build.returncode == 0, build.stderr
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(out))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def browser(site: str) -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1280,1000",
                "--no-first-run", "--disable-background-networking"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(DRIVER), options=opts)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


def test_the_home_page_has_title_navigation_and_a_highlighted_example(site: str, browser: Any,
                                                                      tmp_path: pathlib.Path) -> None:
    from selenium.webdriver.common.by import By

    browser.get(site + "/")
    assert browser.title.startswith("jobq")
    nav = browser.find_element(By.CSS_SELECTOR, "nav.md-nav--primary").get_attribute("textContent")
    for section in ("Getting started", "Tutorial", "Concepts", "How-to guides", "Reference", "Operations",
                    "Performance", "Changelog"):
        assert section in nav, section
    code = browser.find_element(By.CSS_SELECTOR, ".md-content .highlight pre code")
    assert "jobq.create_schema(engine)" in code.text
    assert code.find_elements(By.CSS_SELECTOR, "span.kn")  # highlighted: `import` is a keyword span
    shot = tmp_path / "site-home.png"
    browser.save_screenshot(str(shot))
    assert shot.stat().st_size > 10_000
    print("screenshot of the home page:", shot)


def test_the_reference_pages_render_docstrings_and_the_parser(site: str, browser: Any) -> None:
    from selenium.webdriver.common.by import By

    browser.get(site + "/reference/api/queue/")
    heading = browser.find_element(By.ID, "jobq.enqueue")
    assert "enqueue" in heading.text
    body = browser.find_element(By.CSS_SELECTOR, ".md-content").text
    assert "unique_key" in body and "Raises" in body  # the signature and the docstring's sections
    browser.get(site + "/reference/cli/")
    body = browser.find_element(By.CSS_SELECTOR, ".md-content").text
    assert "usage: jobq worker" in body and "--app MODULE:NAME" in body
