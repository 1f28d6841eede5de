"""The recall demo on the page of `lstmem serve` (issue 26): write a history, ask, see the charts move."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("fastapi", reason="needs the serve extra: pip install -e '.[serve,test]'")
httpx = pytest.importorskip("httpx")

import torch  # noqa: E402

pytestmark = pytest.mark.timeout(300)

HISTORY = "k07 v19 ; k12 v03 ; k01 v05 ; k02 v11 ; k30 v08 ; k21 v27 ; k09 v14 ; k16 v00 ;"


def test_the_page_carries_the_demo_and_its_regular_expressions_reach_the_browser_intact():
    from lstmem_peft.serve.page import PAGE

    for part in ('id="demo"', "Try the recall demo", 'id="dwrite"', 'id="dask"', "X-Session-Id"):
        assert part in PAGE
    # a Python escape would have turned \b into a backspace: the browser must get the backslashes
    assert r"/\b(k\d\d)\s+(v\d\d)\b/g" in PAGE and "\x08" not in PAGE


def test_the_requests_the_page_sends_write_a_session_and_answer_from_it(tmp_path):
    """What the page's buttons send, in process: the history written to a session, the question
    asked with the session (from memory) and without one (no history); the session then lists the
    write and the question as its two commits, with the memory norms the charts draw."""
    from lstmem_peft.serve import app as app_module
    from lstmem_peft.serve.loading import load_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    app = app_module.create_app(load_model(), str(tmp_path / "store"))
    app.state.scheduler.start()

    async def page_clicks():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://serve", timeout=60) as client:
            assert "Try the recall demo" in (await client.get("/")).text
            model = (await client.get("/v1/models")).json()["data"][0]["id"]
            wrote = await client.post(
                "/v1/memory/try/write", json={"messages": [{"role": "user", "content": HISTORY}]}
            )
            ask = {
                "model": model,
                "messages": [{"role": "user", "content": "? k12"}],
                "max_tokens": 1,
                "temperature": 0,
            }
            memory = await client.post("/v1/chat/completions", json=ask, headers={"X-Session-Id": "try"})
            none = await client.post("/v1/chat/completions", json=ask)
            info = (await client.get("/v1/memory/try")).json()
            return model, wrote, memory, none, info

    try:
        model, wrote, memory, none, info = asyncio.run(page_clicks())
    finally:
        app.state.scheduler.stop()
        torch.set_num_threads(threads)
    assert model == "lstmem-demo"
    assert wrote.status_code == 200 and wrote.json()["tokens_written"] >= 24
    for reply in (memory, none):
        assert reply.status_code == 200
        assert re.fullmatch(r"\s*\S+\s*", reply.json()["choices"][0]["message"]["content"])
    assert [t["kind"] for t in info["turns"]] == ["write", "chat"]
    assert all(len(t["norms"]["cell"]) == 2 for t in info["turns"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_the_page_runs_the_demo_unattended_in_headless_chromium(tmp_path):
    """``/?demo=8&ask=3``: a random history of 8 facts written, three of its keys asked; the page
    shows three rows (gold, memory answer, no-history answer) and the session's charts."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("no chromium on PATH (Debian: apt-get install -y chromium)")
    port = _free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    log = open(tmp_path / "serve.log", "wb")
    server = subprocess.Popen(
        [sys.executable, "-m", "lstmem_cli", "serve", "--store", str(tmp_path / "store")]
        + ["--port", str(port), "--threads", "1"],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        common = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=20000"]
        dom = subprocess.run(
            common + ["--dump-dom", f"{url}/?demo=8&ask=3&session=try"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert dom.returncode == 0, dom.stderr[-2000:]
        shown = dom.stdout.split("<script>")[0]  # the rendered page, not the script's templates
        rows = re.findall(r'<tr class="demo-row">(.*?)</tr>', shown)
        assert len(rows) == 3, dom.stdout[-3000:]
        for row in rows:
            cells = re.findall(r"<td[^>]*>(.*?)</td>", row)
            assert re.fullmatch(r"\? k\d\d", cells[0]) and re.fullmatch(r"v\d\d", cells[1])
            assert row.count('class="right"') + row.count('class="wrong"') == 2
        assert [re.findall(r"<td>(Q\d)</td>", row) for row in rows] == [["Q1"], ["Q2"], ["Q3"]]
        assert re.search(
            r"recall from memory by question position \(session try, this page\): Q1 [01]/1", shown
        )
        assert "Session try" in shown and "polyline" in shown and "25 tokens written" in shown
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()
