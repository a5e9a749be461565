"""The chat page at `/` in a real headless Chromium, against the real server."""

import shutil

import pytest
from helpers import start_server, stop_server

webdriver = pytest.importorskip("selenium.webdriver")
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

pytestmark = pytest.mark.skipif(
    shutil.which("chromedriver") is None,
    reason="needs Chromium and chromedriver: apt-get install chromium chromium-driver (.ci/run does)",
)


@pytest.fixture(scope="module")
def page():
    proc, url = start_server("--max-model-len", "512")
    options = webdriver.ChromeOptions()
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(flag)
    options.binary_location = shutil.which("chromium") or shutil.which("chromium-browser") or ""
    browser = webdriver.Chrome(options=options, service=webdriver.ChromeService(shutil.which("chromedriver")))
    try:
        browser.get(url + "/")
        yield browser
    finally:
        browser.quit()
        stop_server(proc)


def turns(browser):
    return [(e.get_attribute("class"), e.text) for e in browser.find_elements(By.CSS_SELECTOR, "#log .turn")]


def send(browser, text: str) -> None:
    box = browser.find_element(By.ID, "input")
    box.send_keys(text)
    browser.find_element(By.ID, "send").click()


def test_two_turns_stream_in_and_report_their_figures(page):
    WebDriverWait(page, 20).until(lambda b: b.find_element(By.ID, "model").text == "mlxkv-demo")
    send(page, "The import statement")
    WebDriverWait(page, 60).until(lambda b: "tokens/s" in b.find_element(By.ID, "figures").text)
    first = turns(page)
    assert first[0] == ("turn user", "The import statement")
    assert first[1][0] == "turn assistant" and first[1][1].strip()
    send(page, "A class definition")
    WebDriverWait(page, 60).until(
        lambda b: (
            len(turns(b)) == 4
            and "reused" in b.find_element(By.ID, "figures").text
            and not b.find_element(By.ID, "send").get_attribute("disabled")
        )
    )
    figures = page.find_element(By.ID, "figures").text
    assert "prompt tokens reused" in figures and "KV cache:" in figures and "pages in use" in figures
    assert turns(page)[3][1].strip()
    page.find_element(By.ID, "reset").click()
    assert turns(page) == []


def test_model_output_is_shown_as_text_never_run_as_markup(page):
    """A reply holding markup (served here by a stub of fetch, as the tiny model will not write
    it) appears verbatim, and its script never runs."""
    markup = "<script>window.pwned = 1</script><b>bold</b> <img src=x onerror='window.pwned = 2'>"
    page.execute_script(
        """
        const markup = arguments[0], realFetch = window.fetch;
        window.fetch = (url, options) => {
          if (!String(url).endsWith("/v1/chat/completions")) return realFetch(url, options);
          const chunk = {choices: [{index: 0, delta: {content: markup}, finish_reason: "stop"}]};
          const body = `data: ${JSON.stringify(chunk)}\\n\\ndata: [DONE]\\n\\n`;
          return Promise.resolve(new Response(body, {headers: {"Content-Type": "text/event-stream"}}));
        };""",
        markup,
    )
    send(page, "Say something risky")
    WebDriverWait(page, 20).until(lambda b: len(turns(b)) >= 2 and turns(b)[-1][1] == markup)
    assert page.execute_script("return window.pwned === undefined")
    assert page.find_elements(By.CSS_SELECTOR, "#log b, #log img, #log script") == []
