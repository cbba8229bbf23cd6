"""The chat page in headless Chromium, driven as a person would: real mouse clicks on the message
box, Send, Stop and New chat, and the Enter key, through the DevTools protocol (driven by
tests/page_clicks.rs).

    python page_clicks.py CHROMIUM BASE_URL API_KEY

Steps: type a message and click Send; once the answer streams, click Stop: the answer ends (marked
stopped, nothing more arrives); click New chat; type another message and press Enter: it is
answered in full. Prints one JSON line of what it saw; exits 1 with the reason on a failure.
"""

import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

import websocket

CHROME, BASE, KEY = sys.argv[1], sys.argv[2], sys.argv[3]


class Page:
    def __init__(self, ws):
        self.ws, self.n = ws, 0

    def call(self, method, **params):
        self.n += 1
        self.ws.send(json.dumps({"id": self.n, "method": method, "params": params}))
        while True:
            m = json.loads(self.ws.recv())
            if m.get("id") == self.n:
                if "error" in m:
                    raise RuntimeError(f"{method}: {m['error']}")
                return m.get("result", {})

    def js(self, expr):
        r = self.call("Runtime.evaluate", expression=expr, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            fail(f"{expr}: {r['exceptionDetails']}")
        return r.get("result", {}).get("value")

    def click(self, element_id):
        """A real click: the mouse pressed and released at the element's centre."""
        rect = self.js(f"(() => {{ const r = document.getElementById('{element_id}').getBoundingClientRect(); "
                       "return JSON.stringify([r.x + r.width / 2, r.y + r.height / 2]); })()")
        if rect is None:
            fail(f"no element {element_id} to click")
        rect = json.loads(rect)
        x, y = rect
        for kind in ("mouseMoved", "mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)

    def type(self, text):
        self.call("Input.insertText", text=text)

    def enter(self):
        for kind in ("keyDown", "keyUp"):
            self.call("Input.dispatchKeyEvent", type=kind, key="Enter", code="Enter", windowsVirtualKeyCode=13,
                      text="\r" if kind == "keyDown" else "")

    def wait(self, expr, what, limit=120):
        t0 = time.time()
        while time.time() - t0 < limit:
            v = self.js(expr)
            if v:
                return v
            time.sleep(0.05)
        fail(f"timed out waiting for {what}: {self.js('document.body.outerHTML')[:3000]}")


def fail(why):
    print(why, file=sys.stderr)
    sys.exit(1)


def main():
    profile = tempfile.mkdtemp()
    proc = subprocess.Popen([CHROME, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                             "--no-first-run", "--disable-background-networking", "--disable-component-update",
                             "--disable-sync", "--remote-debugging-port=0", "--remote-allow-origins=*", f"--user-data-dir={profile}",
                             "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        port_file = os.path.join(profile, "DevToolsActivePort")
        t0 = time.time()
        while not os.path.exists(port_file) or not open(port_file).read().strip():
            if time.time() - t0 > 60 or proc.poll() is not None:
                fail("Chromium did not open its DevTools port")
            time.sleep(0.1)
        port = open(port_file).read().split()[0]
        pages = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list"))
        target = next(p for p in pages if p.get("type") == "page")
        p = Page(websocket.create_connection(target["webSocketDebuggerUrl"], timeout=120, suppress_origin=True))
        p.call("Page.enable")
        p.call("Page.navigate", url=f"{BASE}/?key={KEY}&max_tokens=2000&effort=none")
        p.wait("document.readyState === 'complete' && !!document.getElementById('send')", "the page")
        # 1. A message typed into the box and sent with the Send button.
        p.click("input")
        p.type("Tell me a long story about the sea.")
        p.click("send")
        p.wait("document.body.dataset.state === 'busy'", "the request to start")
        p.wait("(document.getElementById('answer-1') || {}).textContent && "
               "document.getElementById('answer-1').textContent.length >= 3", "the answer to stream")
        # 2. Stop while it streams.
        p.click("stop")
        p.wait("document.getElementById('answer-1').dataset.stopped === '1'", "the answer to stop")
        shown = p.js("document.getElementById('answer-1').textContent")
        time.sleep(1.5)
        after = p.js("document.getElementById('answer-1').textContent")
        if after != shown:
            fail(f"text kept arriving after Stop: {len(shown)} -> {len(after)} characters")
        if p.js("document.body.dataset.state") == "busy":
            fail("the page still shows a request running after Stop")
        # 3. New chat, then a message sent with Enter, answered in full.
        p.click("new")
        p.wait("document.querySelectorAll('.msg').length === 0", "New chat to clear the conversation")
        p.click("input")
        p.type("Hello")
        p.enter()
        p.wait("(document.getElementById('answer-1') || {dataset: {}}).dataset.done === '1'", "the second answer")
        second = p.js("document.getElementById('answer-1').textContent")
        error = p.js("document.getElementById('answer-1').dataset.error || ''")
        if error or not second.strip():
            fail(f"the second answer is empty or failed: {second!r} {error!r}")
        history = p.js("document.querySelectorAll('.msg.user').length")
        print(json.dumps({"stopped_at_chars": len(shown), "second_answer_chars": len(second), "user_messages": history}))
    finally:
        proc.terminate()
        proc.wait()


main()
