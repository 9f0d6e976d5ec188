"""``serve``'s web pages in a real headless Chromium, under the server's own Content-Security-Policy (no bypass):
the job list with state and progress, a job's URL that survives a reload, the before / after comparison at a
viewable size side by side with a slider, the demo-weights banner, and the API reference served from the package
(offline, with a token). Screenshots are kept in ``test-artifacts/serve_page/`` (``WINSP_TEST_ARTIFACTS`` moves
them). Traffic goes to 127.0.0.1 only; a request anywhere else fails the test.
"""

from __future__ import annotations

import os

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("av")

from tests.test_cli import make_mp4  # noqa: E402
from tests.test_serve import JOB_S, REPO, TOKEN, Served, _chromium  # noqa: E402

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run"]


def _artifacts() -> str:
    folder = os.environ.get("WINSP_TEST_ARTIFACTS") or os.path.join(REPO, "test-artifacts")
    folder = os.path.join(folder, "serve_page")
    os.makedirs(folder, exist_ok=True)
    return folder


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("page")
    server = Served(str(tmp), token=True)
    yield server
    server.stop()


class _Browser:
    """One Chromium page that records every request and every console complaint (a CSP violation among them)."""

    def __init__(self, playwright, served) -> None:
        self.browser = playwright.chromium.launch(executable_path="/usr/bin/chromium", args=FLAGS)
        self.page = self.browser.new_page(viewport={"width": 1280, "height": 1000})
        self.requests: list[str] = []
        self.complaints: list[str] = []
        self.page.on("request", lambda r: self.requests.append(r.url))
        self.page.on("console", lambda m: self.complaints.append(m.text) if m.type in ("error", "warning") else None)
        self.served = served

    def foreign(self) -> list[str]:
        return [u for u in self.requests if not u.startswith(self.served.url) and not u.startswith(("blob:", "data:"))]


@pytest.mark.browser
def test_the_page_lists_jobs_keeps_a_job_across_a_reload_and_compares_before_and_after(served, tmp_path):
    playwright = _chromium()
    clip = make_mp4(tmp_path / "clip.mp4", t=5, h=32, w=48)
    shots = _artifacts()
    hostile = '<img src=x onerror=document.title=1><b>clip.mp4'  # a name shown as text, never as markup
    with open(clip, "rb") as f:
        other = served.client.post("/v1/restorations", files={"file": (hostile, f)},
                                   data={"crf": "0", "seed": "3"}).json()["id"]  # another client's job: listed too
    with playwright.sync_playwright() as p:
        seen = _Browser(p, served)
        page = seen.page
        try:
            page.goto(served.url + "/")
            assert page.locator("#banner").is_visible()  # the demo weights: their output is noise
            page.fill("#token", TOKEN)
            page.set_input_files("#file", clip)
            page.fill("#crf", "0")
            page.click("#submit")
            page.wait_for_url("**/#job=*", timeout=30_000)
            job = page.url.split("#job=")[1]
            assert len(job) == 32
            page.locator("#state", has_text="done").wait_for(timeout=JOB_S * 1000)
            rows = page.locator("#rows tr")
            rows.filter(has_text="done").nth(1).wait_for(timeout=JOB_S * 1000)  # both jobs, both done
            assert rows.count() >= 2
            assert page.locator(f'#rows tr[data-id="{other}"]').count() == 1
            assert page.locator(f'#rows tr[data-id="{other}"] td').first.inner_text() == hostile
            assert page.locator("#rows img, #rows b").count() == 0 and page.title() == "SeedVR2 restoration"
            page.locator("#compare video").nth(1).wait_for(timeout=30_000)
            before = page.locator("#before video").bounding_box()
            after = page.locator("#after video").bounding_box()
            assert before["width"] >= 320 and after["width"] >= 320, (before, after)  # not 48x32
            assert abs(before["y"] - after["y"]) < 2 and after["x"] > before["x"] + before["width"] - 1  # side by side
            assert page.locator("#before video").get_attribute("src").startswith("blob:")
            page.locator("#wipe-after video").wait_for()
            assert "inset(0px 0px 0px 50%)" in page.locator("#wipe-after").get_attribute("style").replace(
                "0 0 0", "0px 0px 0px")
            page.locator("#slider").focus()
            for _ in range(20):
                page.keyboard.press("ArrowRight")
            assert "70%" in page.locator("#wipe-after").get_attribute("style")
            page.screenshot(path=os.path.join(shots, "done_and_compared.png"), full_page=True)
            page.reload()  # the job's URL and the token survive it
            page.locator("#title", has_text=job).wait_for(timeout=30_000)
            page.locator("#after video").wait_for(timeout=30_000)
            assert page.url.endswith("#job=" + job)
            page.screenshot(path=os.path.join(shots, "after_reload.png"), full_page=True)
            page.locator(f'#rows tr[data-id="{other}"]').click()  # another job from the list
            page.wait_for_url(f"**/#job={other}")
            page.locator("#title", has_text=other).wait_for()
        finally:
            seen.browser.close()
    assert not seen.foreign(), seen.foreign()
    assert not [c for c in seen.complaints if "Content Security Policy" in c], seen.complaints


@pytest.mark.browser
def test_the_api_reference_is_served_from_the_package_and_works_offline_with_a_token(served):
    playwright = _chromium()
    bare = httpx.get(served.url + "/docs", timeout=30)
    assert bare.status_code == 200 and "cdn" not in bare.text.lower()
    assert httpx.get(served.url + "/openapi.json", timeout=30).status_code == 401
    with playwright.sync_playwright() as p:
        seen = _Browser(p, served)
        page = seen.page
        try:
            page.goto(served.url + "/docs")
            page.locator("#error", has_text="bearer token").wait_for(timeout=30_000)
            page.fill("#token", TOKEN)
            page.click("#load")
            page.locator("#api .op").nth(4).wait_for(timeout=30_000)
            text = page.locator("#api").inner_text()
            assert "/v1/restorations" in text and "Submit a restoration job" in text and "scale" in text
            page.screenshot(path=os.path.join(_artifacts(), "api_reference.png"), full_page=True)
        finally:
            seen.browser.close()
    assert not seen.foreign(), seen.foreign()
    assert not [c for c in seen.complaints if "Content Security Policy" in c], seen.complaints
