"""The chat page at `/` in a real headless Chromium, against the real server."""

import json
import re
import shutil
import time

import httpx
import pytest
from helpers import start_server, stop_server

from mlxkv.models.random_model import TOOLS_CHAT_TEMPLATE, make_checkpoint

webdriver = pytest.importorskip("selenium.webdriver")
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402

pytestmark = pytest.mark.skipif(
    shutil.which("chromedriver") is None,
    reason="needs Chromium and chromedriver: apt-get install chromium chromium-driver (.ci/run does)",
)


def chromium():
    options = webdriver.ChromeOptions()
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(flag)
    options.binary_location = shutil.which("chromium") or shutil.which("chromium-browser") or ""
    return webdriver.Chrome(options=options, service=webdriver.ChromeService(shutil.which("chromedriver")))


@pytest.fixture(scope="module")
def served():
    proc, url = start_server("--max-model-len", "2048")
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def page(served):
    browser = chromium()
    try:
        browser.get(served + "/")
        yield browser
    finally:
        browser.quit()


def metric(url: str, name: str, headers: dict | None = None) -> float:
    text = httpx.get(f"{url}/metrics", headers=headers).text
    return float(re.search(rf"^mlxkv_{name}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE).group(1))


def set_field(browser, field: str, value: str) -> None:
    box = browser.find_element(By.ID, field)
    box.clear()
    box.send_keys(value)


def turns(browser):
    return [(e.get_attribute("class"), e.text) for e in browser.find_elements(By.CSS_SELECTOR, "#log .turn")]


def send(browser, text: str) -> None:
    box = browser.find_element(By.ID, "input")
    box.send_keys(text)
    browser.find_element(By.ID, "send").click()


def test_two_turns_stream_in_and_report_their_figures(page):
    WebDriverWait(page, 20).until(lambda b: b.find_element(By.ID, "model").text == "mlxkv-demo")
    assert not page.find_element(By.ID, "tools-panel").is_displayed()  # the demo model has no tool calls
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
    assert re.search(r"weights \d+\.\d\d [KMG]B, KV \d+\.\d\d [KMG]B", figures) and "weights 0.00" not in figures
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


def reload(browser, url: str) -> None:
    """A fresh page (an earlier test may have stubbed its fetch), once it has listed the model."""
    browser.get(url + "/")
    WebDriverWait(browser, 20).until(lambda b: b.find_element(By.ID, "model").text == "mlxkv-demo")


def record_requests(browser) -> None:
    """Keep the body of every chat request the page sends in `window.sent`."""
    browser.execute_script("""
        window.sent = [];
        const realFetch = window.fetch;
        window.fetch = (url, options) => {
          if (String(url).endsWith("/v1/chat/completions")) window.sent.push(JSON.parse(options.body));
          return realFetch(url, options);
        };""")


def test_max_tokens_and_temperature_go_with_the_request(page, served):
    reload(page, served)
    record_requests(page)
    set_field(page, "max-tokens", "5")
    set_field(page, "temperature", "0")
    send(page, "The import statement")
    WebDriverWait(page, 60).until(lambda b: b.find_element(By.ID, "figures").text.startswith("5 tokens,"))
    [body] = page.execute_script("return window.sent")
    assert (body["max_tokens"], body["temperature"], body["stream"]) == (5, 0, True)


def test_stop_ends_the_reply_and_the_server_frees_its_pages_at_once(page, served):
    reload(page, served)
    # Greedy, the demo model writes 2,352 tokens for this prompt before its EOS: seconds on any
    # machine, however loaded, against the fraction of one a click takes after the first text.
    set_field(page, "max-tokens", "2000")
    set_field(page, "temperature", "0")
    send(page, "The import statement")
    WebDriverWait(page, 60, poll_frequency=0.01).until(lambda b: len(turns(b)) == 2 and len(turns(b)[1][1]) > 10)
    page.find_element(By.ID, "stop").click()
    WebDriverWait(page, 30).until(lambda b: b.find_element(By.ID, "figures").text.startswith("stopped after"))
    generated = int(re.match(r"stopped after (\d+) tokens", page.find_element(By.ID, "figures").text).group(1))
    assert 0 < generated < 2000
    deadline = time.monotonic() + 10
    while (metric(served, "running_requests"), metric(served, "kv_pages_used")) != (0, 0):
        assert time.monotonic() < deadline, "the stopped request still holds its pages"
        time.sleep(0.05)
    assert page.find_element(By.ID, "send").is_enabled() and not page.find_element(By.ID, "stop").is_enabled()
    assert turns(page)[1][0] == "turn assistant stopped"  # the partial reply stays, marked as stopped


def test_with_an_api_key_the_page_loads_asks_for_the_key_and_chats():
    proc, url = start_server("--api-key", "sesame", "--max-model-len", "256")
    browser = chromium()
    try:
        assert httpx.get(f"{url}/").status_code == 200 and httpx.get(f"{url}/v1/models").status_code == 401
        browser.get(url + "/")
        WebDriverWait(browser, 20).until(lambda b: b.find_element(By.ID, "key-form").is_displayed())
        assert browser.find_element(By.ID, "key-ask").text == "This server wants an API key:"
        set_field(browser, "key", "open sesame")
        browser.find_element(By.ID, "use-key").click()
        WebDriverWait(browser, 20).until(lambda b: "refused" in b.find_element(By.ID, "key-ask").text)
        assert browser.find_element(By.ID, "model").text == "the server refused the API key: enter the right one above"
        set_field(browser, "key", "sesame")
        browser.find_element(By.ID, "use-key").click()
        WebDriverWait(browser, 20).until(lambda b: b.find_element(By.ID, "model").text == "mlxkv-demo")
        assert not browser.find_element(By.ID, "key-form").is_displayed()
        set_field(browser, "max-tokens", "6")
        send(browser, "The import statement")
        WebDriverWait(browser, 60).until(lambda b: b.find_element(By.ID, "figures").text.startswith("6 tokens,"))
        assert "pages in use" in browser.find_element(By.ID, "figures").text  # /metrics, with the key
    finally:
        browser.quit()
        stop_server(proc)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


def test_tool_calls_show_as_calls_and_the_next_message_answers_them(tmp_path):
    """With a tool offered and a call required, the reply shows as the call it is (never the
    model's markup), and the next message goes back as the tool's answer to that call."""
    make_checkpoint(tmp_path / "tiny-tools", chat_template=TOOLS_CHAT_TEMPLATE, max_position_embeddings=4096)
    proc, url = start_server("--model", "tiny-tools", cwd=tmp_path)
    browser = chromium()
    try:
        browser.get(url + "/")
        WebDriverWait(browser, 20).until(lambda b: b.find_element(By.ID, "model").text == "tiny-tools")
        record_requests(browser)
        WebDriverWait(browser, 20).until(lambda b: b.find_element(By.ID, "tools-panel").is_displayed())
        browser.find_element(By.CSS_SELECTOR, "#tools-panel summary").click()
        set_field(browser, "tools", json.dumps([WEATHER]))
        Select(browser.find_element(By.ID, "tool-choice")).select_by_visible_text("required")
        browser.find_element(By.ID, "parallel").click()
        set_field(browser, "max-tokens", "200")
        send(browser, "Weather in Paris?")
        WebDriverWait(browser, 60).until(lambda b: "tokens/s" in b.find_element(By.ID, "figures").text)
        shown = turns(browser)
        assert [role for role, _ in shown] == ["turn user", "turn tool-call"]
        arguments = re.fullmatch(r"tool call: get_weather\((\{.*\})\)", shown[1][1]).group(1)
        assert set(json.loads(arguments)) == {"city"}
        send(browser, "sunny")
        WebDriverWait(browser, 60).until(lambda b: len(b.execute_script("return window.sent")) == 2)
        asked = browser.execute_script("return window.sent")
        assistant, answer = asked[1]["messages"][-2:]
        (made,) = assistant["tool_calls"]
        assert made["function"] == {"name": "get_weather", "arguments": arguments}
        assert answer == {"role": "tool", "tool_call_id": made["id"], "content": "sunny"}
        assert asked[0]["tool_choice"] == "required" and asked[0]["parallel_tool_calls"] is False
        assert turns(browser)[2] == ("turn tool-result", "tool answer: sunny")
    finally:
        browser.quit()
        stop_server(proc)


def test_a_five_turn_chat_reuses_every_token_computed_for_the_turns_before():
    """At the page's temperature (0.7), replies of 200 tokens: re-encoding such a reply would give
    other tokens (the demo model writes "\\n" "\\n" where the tokenizer has "\\n\\n"), so each turn
    reuses the previous prompt and reply (less its last token, sampled but never run) only if the
    server keeps the reply's own ids."""
    proc, url = start_server("--max-model-len", "2048")
    browser = chromium()
    try:
        browser.get(url + "/")
        WebDriverWait(browser, 20).until(lambda b: b.find_element(By.ID, "model").text == "mlxkv-demo")
        assert browser.find_element(By.ID, "temperature").get_attribute("value") == "0.7"
        set_field(browser, "max-tokens", "200")
        figures, line = [], ""
        for turn in range(5):
            send(browser, f"Question {turn}: what does the with statement do?")
            shown = 2 * (turn + 1)
            WebDriverWait(browser, 120).until(  # the figures line is written after Send is enabled again
                lambda b, shown=shown, before=line: (
                    len(turns(b)) == shown
                    and "reused" in (now := b.find_element(By.ID, "figures").text)
                    and now != before
                )
            )
            line = browser.find_element(By.ID, "figures").text
            generated, reused, prompt = re.match(
                r"(\d+) tokens, .*?, (\d+) of (\d+) prompt tokens reused", line
            ).groups()
            figures.append((int(generated), int(reused), int(prompt)))
    finally:
        browser.quit()
        stop_server(proc)
    expected = [0] + [prompt + generated - (generated == 200) for generated, _, prompt in figures[:-1]]
    assert [reused for _, reused, _ in figures] == expected


def test_the_temperature_field_starts_at_the_server_s_default(tmp_path):
    path = make_checkpoint(tmp_path / "tiny")
    (path / "generation_config.json").write_text('{"temperature": 0.6, "top_p": 0.95}')
    proc, url = start_server("--model", str(path), "--max-model-len", "256")
    browser = chromium()
    try:
        browser.get(url + "/")
        field = browser.find_element(By.ID, "temperature")
        WebDriverWait(browser, 20).until(lambda b: field.get_attribute("value") == "0.6")
    finally:
        browser.quit()
        stop_server(proc)


def test_a_thinking_model_s_reasoning_is_folded_above_its_answer(tmp_path):
    template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
    )
    path = make_checkpoint(tmp_path / "thinker", chat_template=template)
    proc, url = start_server("--model", str(path), "--max-model-len", "256")
    browser = chromium()
    try:
        browser.get(url + "/")
        WebDriverWait(browser, 20).until(lambda b: b.find_element(By.ID, "model").text == str(path))
        set_field(browser, "max-tokens", "12")
        set_field(browser, "temperature", "0")
        send(browser, "Hello")
        WebDriverWait(browser, 60).until(lambda b: "tokens/s" in b.find_element(By.ID, "figures").text)
        box = browser.find_element(By.CSS_SELECTOR, "#log details.thinking")
        assert box.get_attribute("open") is None  # folded
        shown = browser.execute_script("return arguments[0].lastChild.textContent", box)
        body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 12, "temperature": 0}
        message = httpx.post(f"{url}/v1/chat/completions", json=body).json()["choices"][0]["message"]
        assert shown == message["reasoning_content"] != ""
        assert [kind for kind, _ in turns(browser)] == ["turn user", "turn thinking", "turn assistant"]
    finally:
        browser.quit()
        stop_server(proc)


def test_an_attached_image_goes_with_the_message_and_the_reply_streams_in(tmp_path):
    """A model that reads images shows an Image button: a picked image is shown in the user's turn
    and sent as an image_url part with the message; the reply streams in. The page as it looks
    then is kept in `MLXKV_SCREENSHOT` if set (the issue's closing note shows it)."""
    pytest.importorskip("mlx_vlm")
    import os

    import numpy as np
    from PIL import Image

    from mlxkv.models.random_vision_model import make_vision_checkpoint

    make_vision_checkpoint(tmp_path / "tiny-vision", "qwen3_vl")
    picture = tmp_path / "cat.png"
    Image.fromarray(np.random.default_rng(5).integers(0, 256, (48, 64, 3), dtype=np.uint8)).save(picture)
    proc, url = start_server("--model", "tiny-vision", "--max-model-len", "512", cwd=tmp_path)
    browser = chromium()
    try:
        browser.get(url + "/")
        WebDriverWait(browser, 20).until(lambda b: b.find_element(By.ID, "attach-label").is_displayed())
        record_requests(browser)
        set_field(browser, "max-tokens", "12")
        browser.find_element(By.ID, "attach").send_keys(str(picture))
        WebDriverWait(browser, 10).until(lambda b: b.find_elements(By.CSS_SELECTOR, "#attached img"))
        send(browser, "What is in this picture?")
        WebDriverWait(browser, 60).until(lambda b: "tokens/s" in b.find_element(By.ID, "figures").text)
        (body,) = browser.execute_script("return window.sent")
        image, text = body["messages"][-1]["content"]
        assert image["type"] == "image_url" and image["image_url"]["url"].startswith("data:image/png;base64,")
        assert text == {"type": "text", "text": "What is in this picture?"}
        shown = turns(browser)
        assert shown[0] == ("turn user", "What is in this picture?") and shown[1][0] == "turn assistant"
        assert shown[1][1].strip() and browser.find_elements(By.CSS_SELECTOR, "#log .user img")
        assert not browser.find_elements(By.CSS_SELECTOR, "#attached img")  # sent: the next message has none
        if os.environ.get("MLXKV_SCREENSHOT"):
            browser.save_screenshot(os.environ["MLXKV_SCREENSHOT"])
    finally:
        browser.quit()
        stop_server(proc)


def test_a_server_of_several_models_offers_a_picker_and_the_figures_are_the_picked_models(tmp_path):
    for seed, name in enumerate(("chat-a", "chat-b")):
        make_checkpoint(tmp_path / name, seed=seed, chat_template=TOOLS_CHAT_TEMPLATE, max_position_embeddings=1024)
    proc, url = start_server("--model", str(tmp_path), "--num-pages", "48", "--max-model-len", "512")
    browser = chromium()
    try:
        browser.get(url + "/")
        WebDriverWait(browser, 20).until(lambda b: b.find_element(By.ID, "model").text == "chat-a")
        picker = Select(browser.find_element(By.ID, "model-picker"))
        assert [o.text for o in picker.options] == [
            "chat-a",
            "chat-b",
        ] and picker.first_selected_option.text == "chat-a"
        record_requests(browser)
        picker.select_by_visible_text("chat-b")
        WebDriverWait(browser, 20).until(lambda b: b.find_element(By.ID, "model").text == "chat-b")
        send(browser, "Hello there")
        WebDriverWait(browser, 60).until(lambda b: "tokens/s" in b.find_element(By.ID, "figures").text)
        assert [body["model"] for body in browser.execute_script("return window.sent")] == ["chat-b"]
        assert "/48 pages in use" in browser.find_element(By.ID, "figures").text  # chat-b's pool, not NaN
        assert sorted(m["name"] for m in httpx.get(f"{url}/api/ps").json()["models"]) == ["chat-a", "chat-b"]
    finally:
        browser.quit()
        stop_server(proc)
