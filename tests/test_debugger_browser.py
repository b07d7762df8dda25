"""End to end in a real browser (issue 29): JupyterLab in headless Chromium, its debugger panel on,
a breakpoint clicked in the gutter of a cell that runs on 2 ranks, and the variables panel showing
rank 1's local, then a step. Screenshots go to the test's tmp folder: the whole page, and the docs'
pictures cut out of it (the rank cell beside the variables and call stack, narrow enough for the docs
page to show at full size); with ``MPIFY_NB_SCREENSHOTS=docs`` the pictures go over the docs' own
(docs/images/debugger-panel.png and debugger-step.png).

Skipped where Debian's ``chromium``/``chromium-driver`` or JupyterLab and selenium are missing.
Nothing is downloaded: selenium drives /usr/bin/chromium through /usr/bin/chromedriver.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
import uuid

import pytest

import nbutil

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
    pytest.skip("no chromium/chromedriver here (Debian: apt-get install chromium chromium-driver)",
                allow_module_level=True)
pytest.importorskip("jupyterlab")
pytest.importorskip("debugpy")
webdriver = pytest.importorskip("selenium.webdriver")

from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

# The docs' pictures are refreshed on request only (a test run leaves the checkout as it was).
SCREENSHOTS = (nbutil.REPO_ROOT / "docs" / "images") if os.environ.get("MPIFY_NB_SCREENSHOTS") == "docs" else None
KERNEL = "mpify-nb-lab"
CELLS = ["%load_ext mpify_nb", "%dist_init -n 2", "x = rank * 10\nif rank == 1:\n    y = x + 1\nx"]
WAIT = 90.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def lab(tmp_path):
    """A JupyterLab server on 127.0.0.1 (a token), with a kernelspec that has the debugger on, and
    a notebook of CELLS; yields (url, marker). Ended by pid; no kernel of it is left."""
    data = tmp_path / "data"
    spec = data / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "mpify_nb (debugger)", "language": "python", "metadata": {"debugger": True}}))
    root = tmp_path / "root"
    root.mkdir()
    nb = nbutil.new_notebook(CELLS)
    nb.metadata["kernelspec"] = {"name": KERNEL, "display_name": "mpify_nb (debugger)", "language": "python"}
    (root / "debug.ipynb").write_text(json.dumps(nb))
    token, port, marker = uuid.uuid4().hex, _free_port(), uuid.uuid4().hex
    env = dict(os.environ, JUPYTER_PATH=str(data), JUPYTER_CONFIG_DIR=str(tmp_path / "config"),
               JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"), JUPYTERLAB_SETTINGS_DIR=str(tmp_path / "settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "workspaces"), PYDEVD_DISABLE_FILE_VALIDATION="1",
               **{nbutil.MARKER_VAR: marker})
    log = open(tmp_path / "lab.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}", "--allow-root",
         "--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
         "--LabApp.extension_manager=readonly"],
        env=env, stdout=log, stderr=subprocess.STDOUT, cwd=str(root))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + WAIT
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2).read()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise AssertionError("JupyterLab did not start:\n"
                                         + (tmp_path / "lab.log").read_text()[-3000:]) from None
                time.sleep(0.2)
        yield f"{url}/lab/tree/debug.ipynb?token={token}", marker
    finally:
        server.terminate()  # jupyter_server shuts its kernels down on SIGTERM
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(10)
        log.close()
        nbutil.assert_no_leftovers(marker)


@pytest.fixture
def browser(tmp_path):
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--window-size=1400,1100", f"--user-data-dir={tmp_path / 'chromium'}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=webdriver.ChromeService(executable_path=CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def _wait(driver, condition, what: str, timeout: float = WAIT):
    try:
        return WebDriverWait(driver, timeout, poll_frequency=0.2).until(lambda d: condition(d))
    except Exception as e:
        raise AssertionError(f"{what} (waited {timeout} s)") from e


def _run_cell(driver, index: int) -> None:
    """Click into cell ``index``'s editor and run it (Shift+Enter)."""
    cell = driver.find_elements(By.CSS_SELECTOR, ".jp-Notebook .jp-CodeCell")[index]
    cell.find_element(By.CSS_SELECTOR, ".cm-content").click()
    webdriver.ActionChains(driver).key_down(Keys.SHIFT).send_keys(Keys.ENTER).key_up(Keys.SHIFT).perform()


def _click_titled(driver, title: str) -> None:
    """Click the call stack toolbar's button called ``title``."""
    buttons = [b for b in driver.find_elements(By.XPATH, f"//*[@title='{title}']") if b.is_displayed()]
    assert buttons, f"no {title!r} button in the call stack's toolbar"
    buttons[0].click()


#: The widest picture the docs page shows without shrinking it (Material's content column).
PICTURE_WIDTH = 680


def _save_picture(driver, page_png, out) -> None:
    """The rank cell (its prompt, gutter and code) and the debugger's variables and call stack, cut out of
    the page's screenshot and set side by side, at most PICTURE_WIDTH wide: what the docs show, readable.
    The variables list is scrolled to its end first, where the cell's own locals are (x, then y)."""
    from PIL import Image

    for body in driver.find_elements(By.CSS_SELECTOR, ".jp-DebuggerVariables-body"):
        driver.execute_script("arguments[0].scrollTop = arguments[0].scrollHeight", body)
    time.sleep(0.3)  # one repaint (a picture only: nothing is asserted on it)
    driver.save_screenshot(str(page_png))
    scale = float(driver.execute_script("return window.devicePixelRatio") or 1)

    def box(*elements):
        rects = [e.rect for e in elements]
        left, top = min(r["x"] for r in rects), min(r["y"] for r in rects)
        right = max(r["x"] + r["width"] for r in rects)
        bottom = max(r["y"] + r["height"] for r in rects)
        return [round(v * scale) for v in (left, top, right, bottom)]

    page = Image.open(page_png)
    cell = box(driver.find_elements(By.CSS_SELECTOR, ".jp-Notebook .jp-CodeCell")[2])
    # the sidebar from its title (the notebook's name, "VARIABLES") down to the last frame of the call stack
    panel = box(driver.find_element(By.CSS_SELECTOR, ".jp-DebuggerSidebar"))
    frames = box(*driver.find_elements(By.CSS_SELECTOR, ".jp-DebuggerCallstackFrame"))
    panel[3] = frames[3] + round(6 * scale)
    gap = 12
    cell[2] = min(cell[2], cell[0] + PICTURE_WIDTH - gap - (panel[2] - panel[0]))  # the code is short
    left, right = page.crop(tuple(cell)), page.crop(tuple(panel))
    picture = Image.new("RGB", (left.width + gap + right.width, max(left.height, right.height)), "white")
    picture.paste(left, (0, 0))
    picture.paste(right, (left.width + gap, 0))
    assert picture.width <= PICTURE_WIDTH, picture.size
    picture.save(out)


def _output(driver, index: int) -> str:
    cell = driver.find_elements(By.CSS_SELECTOR, ".jp-Notebook .jp-CodeCell")[index]
    return "\n".join(o.text for o in cell.find_elements(By.CSS_SELECTOR, ".jp-OutputArea-output"))


def test_jupyterlab_debugger_panel_shows_rank_1_stopped_in_the_gutter_breakpoint(lab, browser, tmp_path):
    url, _marker = lab
    driver = browser
    driver.get(url)
    _wait(driver, lambda d: len(d.find_elements(By.CSS_SELECTOR, ".jp-Notebook .jp-CodeCell")) == 3,
          "the notebook did not open")
    _wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, ".jp-DebuggerBugButton"),
          "no debugger button in the notebook's toolbar (the kernel does not support debugging?)")
    _run_cell(driver, 0)
    _run_cell(driver, 1)
    _wait(driver, lambda d: "[*]" not in d.find_elements(By.CSS_SELECTOR, ".jp-InputPrompt")[1].text
          and d.find_elements(By.CSS_SELECTOR, ".jp-InputPrompt")[1].text.strip() not in ("[ ]:", ""),
          "%dist_init did not finish")
    driver.find_element(By.CSS_SELECTOR, ".jp-DebuggerBugButton").click()
    _wait(driver, lambda d: "jp-PressedButton" in (d.find_element(By.CSS_SELECTOR, ".jp-DebuggerBugButton")
                                                   .get_attribute("class") or "")
          or d.find_element(By.CSS_SELECTOR, ".jp-DebuggerBugButton").get_attribute("aria-pressed") == "true",
          "the debugger did not turn on")
    # a gutter click on line 3 of the rank cell: only rank 1 runs that line
    cell = driver.find_elements(By.CSS_SELECTOR, ".jp-Notebook .jp-CodeCell")[2]
    cell.find_element(By.CSS_SELECTOR, ".cm-content").click()
    number = _wait(driver, lambda d: [g for g in d.find_elements(By.CSS_SELECTOR, ".jp-Notebook .jp-CodeCell")[2]
                                      .find_elements(By.CSS_SELECTOR, ".cm-lineNumbers .cm-gutterElement")
                                      if g.text.strip() == "3"], "no line numbers in the cell")[0]
    y = number.location["y"]
    gutter = [g for g in cell.find_elements(By.CSS_SELECTOR, ".cm-breakpoint-gutter .cm-gutterElement")
              if g.size.get("height", 0) > 0 and abs(g.location["y"] - y) < 3]
    assert gutter, "no breakpoint gutter on line 3"
    gutter[0].click()
    _wait(driver, lambda d: "Cell [ ]" in d.find_element(By.CSS_SELECTOR, ".jp-DebuggerBreakpoints").text,
          "the breakpoint did not reach the breakpoints panel")
    for button in driver.find_elements(By.XPATH, "//button[normalize-space()='No']"):
        button.click()  # JupyterLab's question about news, over the page
    _run_cell(driver, 2)
    variables = _wait(driver, lambda d: [e for e in d.find_elements(By.CSS_SELECTOR, ".jp-DebuggerVariables")
                                         if "10" in e.text and "x" in e.text],
                      "the variables panel never showed rank 1's x = 10")
    text = variables[0].text
    assert "x" in text and "10" in text
    callstack = driver.find_element(By.CSS_SELECTOR, ".jp-DebuggerCallstack").text
    assert "<module>" in callstack and "mpify_nb" not in callstack
    shots = SCREENSHOTS or tmp_path
    _save_picture(driver, tmp_path / "page-stopped.png", shots / "debugger-panel.png")
    # next: rank 1 steps to line 4, its new local in the panel
    _click_titled(driver, "Next (F10)")
    _wait(driver, lambda d: [e for e in d.find_elements(By.CSS_SELECTOR, ".jp-DebuggerVariables")
                             if "y" in e.text and "11" in e.text], "the variables panel never showed y = 11")
    _save_picture(driver, tmp_path / "page-stepped.png", shots / "debugger-step.png")
    # continue: the cell finishes with both ranks' values
    _click_titled(driver, "Continue (F9)")
    _wait(driver, lambda d: "[rank 1] 10" in _output(d, 2), "the cell did not finish after continue")
    assert "[rank 0] 0" in _output(driver, 2)
